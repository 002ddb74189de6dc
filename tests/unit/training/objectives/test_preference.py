"""onegpu.training.objectives.preference: pairs counted padded or flattened, the reference a frozen copy
or LoRA's base (the same log-probabilities, at step 0 and after steps), held-out figures of a policy that
is its reference (ln 2, no reward, every pair a tie)."""
from __future__ import annotations

import copy
import math

import pytest

torch = pytest.importorskip("torch")

from onegpu.config import from_container  # noqa: E402
from onegpu.training import objectives  # noqa: E402
from onegpu.training.objectives import dpo  # noqa: E402
from onegpu.training.objectives.dpo import PreferenceCollator  # noqa: E402

ROWS = [{"prompt_ids": [5, 6, 7], "chosen_ids": [8, 9], "rejected_ids": [10, 11, 12, 13]},
        {"prompt_ids": [14], "chosen_ids": [15, 16, 17], "rejected_ids": [18]},
        {"prompt_ids": [19, 20], "chosen_ids": [21], "rejected_ids": [22, 23]}]
OBJECTIVE = objectives.get("preference")


def cfg(lora: bool = False):
    model = {"task": "preference", "name_or_path": None, **({"lora": {"r": 4, "alpha": 8.0}} if lora else {})}
    return from_container({"data": {"source": "pairs.jsonl"}, "model": model}, source="test")


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2)).double()


def test_pairs_are_counted_padded_and_flattened():
    """Masks by length: the pad id (8 here) is also a real answer token, a target."""
    padded, flat = PreferenceCollator(8)(ROWS), PreferenceCollator(8, flattened=True)(ROWS)
    assert int(OBJECTIVE.count_batch(padded)) == int(OBJECTIVE.count_batch(flat)) == 3
    assert padded["input_ids"].shape == (6, 7) and flat["input_ids"].shape == (1, 25)
    assert padded["labels"][0].tolist() == [-100, -100, -100, 8, 9, -100, -100]
    assert padded["attention_mask"][0].tolist() == [1, 1, 1, 1, 1, 0, 0]
    assert padded["labels"][1].tolist() == [-100, -100, -100, 10, 11, 12, 13]
    assert flat["position_ids"][0, :12].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]


def _logps(model, batch, reference: bool):
    feats = {k: v for k, v in batch.items() if k != "labels"}
    seq = dpo.sequence_ids(batch)
    if reference:
        return OBJECTIVE.reference_logps(model, feats, batch["labels"], seq, 6)
    with torch.no_grad():
        return dpo.sequence_logps(model(**feats), batch["labels"], seq, 6)[0]


def test_a_frozen_copy_is_the_model_as_built_and_stays_so():
    model = tiny_llama()
    OBJECTIVE.prepare_model(model, cfg())
    ref = objectives.preference.reference_of(model).model
    assert ref is not model and not ref.training and not any(p.requires_grad for p in ref.parameters())
    own = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])  # float64
    assert OBJECTIVE.memory_terms(model) == {"mem_reference_bytes": own} and own > 300 * 32 * 8
    batch = PreferenceCollator(0)(ROWS)
    before = _logps(model, batch, reference=False)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    assert torch.equal(_logps(model, batch, reference=True), before)


def test_loras_disabled_adapter_is_a_frozen_copy_of_the_base_at_step_0_and_after_steps():
    from onegpu.models import lora
    base = tiny_llama()
    frozen = copy.deepcopy(base).eval()
    model = lora.apply(base, cfg(lora=True).model.lora, "preference", False)
    OBJECTIVE.prepare_model(model, cfg(lora=True))
    assert objectives.preference.reference_of(model).model is None  # nothing copied
    assert OBJECTIVE.memory_terms(model) == {"mem_reference_bytes": 0}
    assert OBJECTIVE.estimate_line(model).startswith("the reference model: 0 MiB (LoRA")
    batch = PreferenceCollator(0)(ROWS)
    assert torch.equal(_logps(model, batch, reference=True), _logps(frozen, batch, reference=False))
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    model.train()
    for _ in range(3):  # the adapter moves (B leaves zero), the base does not
        OBJECTIVE.step_loss(model, batch, 3).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert not torch.allclose(_logps(model, batch, reference=False), _logps(frozen, batch, reference=False))
    assert torch.equal(_logps(model, batch, reference=True), _logps(frozen, batch, reference=False))
    assert model.training  # the reference's eval mode was only for its forward


def test_held_out_figures_of_a_policy_that_is_its_reference():
    from datasets import Dataset

    from onegpu.config import Config
    model = tiny_llama()
    c = cfg()
    OBJECTIVE.prepare_model(model, c)
    ds = Dataset.from_list(ROWS * 3)
    tok = type("Tok", (), {"pad_token_id": 0})()
    assert isinstance(c, Config)
    c.evaluate.per_device_eval_batch_size = 4  # batches of 4, 4 and 1 pairs
    m = OBJECTIVE.heldout_metrics(model, tok, ds, c, "cpu", "eval")
    assert m["eval_loss"] == pytest.approx(math.log(2), abs=1e-15) and m["eval_pairs"] == 9
    assert m["eval_samples_per_second"] == pytest.approx(9 / m["eval_runtime"])  # (the contract's eval_ figures)
    assert (m["eval_rewards/accuracies"], m["eval_rewards/ties"], m["eval_rewards/margins"]) == (0.0, 1.0, 0.0)
    assert OBJECTIVE.result_line({"test_" + k[5:]: v for k, v in m.items()}).startswith("DPO loss 0.6931")


def test_precomputed_reference_log_probs_are_the_live_references_per_pair():
    """float32: the columns prepare_data adds (every training and validation pair, batches of 4 pairs) within
    1e-6 of the live frozen copy's log-probabilities, pair by pair (batches of 3); no copy is kept."""
    from datasets import Dataset, DatasetDict

    from onegpu.config import from_container
    pre = from_container({"data": {"source": "pairs.jsonl"}, "model": {"task": "preference", "name_or_path": None},
                          "train": {"dpo": {"precompute_ref_log_probs": True}},
                          "evaluate": {"per_device_eval_batch_size": 4}}, source="test")
    tok = type("Tok", (), {"pad_token_id": 0})()
    model, live = tiny_llama().float(), tiny_llama().float()
    OBJECTIVE.prepare_model(model, pre)
    OBJECTIVE.prepare_model(live, cfg())
    assert OBJECTIVE.memory_terms(model) == {"mem_reference_bytes": 0}
    dsd = OBJECTIVE.prepared_data(DatasetDict(train=Dataset.from_list(ROWS * 3), validation=Dataset.from_list(ROWS)),
                                  model, tok, pre)
    assert dsd["validation"]["ref_chosen_logps"] == dsd["train"]["ref_chosen_logps"][:3]
    batch = PreferenceCollator(0)(ROWS)
    expected = _logps(live, batch, reference=True).tolist()
    got = [x for r in dsd["train"].select(range(3)) for x in (r["ref_chosen_logps"], r["ref_rejected_logps"])]
    assert got == pytest.approx(expected, rel=1e-6, abs=1e-6)
    collated = OBJECTIVE.collator(tok)([dsd["train"][i] for i in range(3)])
    assert collated["ref_logps"].tolist() == got  # carried to the loss, in the sequences' order


def test_a_model_built_elsewhere_has_no_reference():
    with pytest.raises(RuntimeError, match="no DPO reference"):
        objectives.preference.reference_of(tiny_llama())


def test_the_training_run_is_tagged_with_what_its_reference_was():
    """The run's onegpu.dpo_reference tag: a frozen copy, LoRA's base, or precomputed and from where."""
    from datasets import Dataset, DatasetDict
    OBJECTIVE.prepare_model(frozen := tiny_llama(), cfg())
    assert OBJECTIVE.run_tags(frozen) == {"onegpu.dpo_reference": "a frozen copy of the model as built (eval mode, "
                                                                  "no gradient)"}
    from onegpu.config import LoraConfig
    from onegpu.models import lora
    base = lora.apply(tiny_llama().float(), LoraConfig(r=4, alpha=8.0), "preference", False)
    OBJECTIVE.prepare_model(base, cfg(lora=True))
    assert OBJECTIVE.run_tags(base)["onegpu.dpo_reference"] == "the policy's base, its LoRA adapter disabled"
    pre = from_container({"data": {"source": "pairs.jsonl"}, "model": {"task": "preference", "name_or_path": None},
                          "train": {"dpo": {"precompute_ref_log_probs": True}}}, source="test")
    OBJECTIVE.prepare_model(scored := tiny_llama().float(), pre)
    OBJECTIVE.prepared_data(DatasetDict(train=Dataset.from_list(ROWS)), scored, type("T", (), {"pad_token_id": 0})(),
                            pre)
    assert OBJECTIVE.run_tags(scored) == {"onegpu.dpo_reference": (
        "precomputed: scored before step 1 (data/reference holds no scores (the reference stage: dvc repro))")}


def test_a_micro_batch_of_repeats_weighs_0_and_leaves_the_steps_figures():
    """pad_loss (several processes, an epoch's last step): a loss of 0 whose backward adds exactly 0 to every
    gradient, and the step's figures (rewards/*, pairs) as the micro-batches before it left them."""
    model = tiny_llama()
    OBJECTIVE.prepare_model(model, cfg())
    batch = PreferenceCollator(0)(ROWS)
    OBJECTIVE.step_loss(model, batch, 3).backward()
    kept = objectives.preference.reference_of(model).sums.clone()
    grads = [p.grad.clone() for p in model.parameters()]
    loss = OBJECTIVE.pad_loss(model, batch)
    loss.backward()
    assert float(loss) == 0.0 and torch.equal(objectives.preference.reference_of(model).sums, kept)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))


@pytest.mark.parametrize("how", ["frozen", "lora", "precomputed"])
def test_under_sharding_the_frozen_reference_is_sharded_and_no_other(how):
    """Objective.shard (train.fsdp, after the policy is sharded): the frozen copy goes to the shard function; LoRA's
    reference is the policy itself and a precomputed one no model: nothing more to shard."""
    model, sharded = tiny_llama(), []
    if how == "lora":
        from onegpu.config import LoraConfig
        from onegpu.models import lora
        model = lora.apply(model, LoraConfig(r=4, alpha=8.0), "preference", False)
    c = cfg(lora=how == "lora")
    if how == "precomputed":
        c.train.dpo.precompute_ref_log_probs = True
    OBJECTIVE.prepare_model(model, c)
    OBJECTIVE.shard(model, sharded.append)
    assert sharded == ([objectives.preference.reference_of(model).model] if how == "frozen" else [])
