"""The `auto` micro-batch finder and out-of-memory recovery (onegpu.training.memory.autobatch, ExactLossTrainer)."""
from __future__ import annotations

import pytest
import torch
from datasets import Dataset

from onegpu import config
from onegpu.errors import ConfigError, UserError
from onegpu.measure import memory
from onegpu.models import loader
from onegpu.training import objectives
from onegpu.training.backends import accelerate as accel, hf_trainer
from onegpu.training.backends.base import TrainRequest
from onegpu.training.memory import autobatch
from onegpu.training.objectives.loss import classification_loss

BACKENDS = pytest.mark.parametrize("backend", [hf_trainer, accel], ids=["trainer", "accelerate"])

LABELS = ["a", "b", "c"]


def tiny_bert(tokenizer):
    from transformers import BertConfig, BertForSequenceClassification
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=64, num_labels=3,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return BertForSequenceClassification(cfg)


def cfg_for(micro, accum, **train):
    raw = {"model": {"dropout": 0.0},
           "train": {"per_device_train_batch_size": micro, "gradient_accumulation_steps": accum, "max_steps": 3,
                     "learning_rate": 1e-3, "logging_steps": 100, **train}}
    return config.from_container(raw)


def test_divisors_largest_first():
    assert autobatch.divisors_desc(32) == [32, 16, 8, 4, 2, 1]
    assert autobatch.divisors_desc(12) == [12, 6, 4, 3, 2, 1]


def test_longest_rows_are_the_worst_case(dsd):
    rows = autobatch.longest_rows(dsd["train"], 4)
    lengths = dsd["train"]["length"]
    assert sorted((lengths[i] for i in rows), reverse=True) == sorted(lengths, reverse=True)[:4]


def test_finder_takes_the_largest_divisor_that_fits_the_budget(tokenizer, dsd):
    model = tiny_bert(tokenizer)
    ds = objectives.model_inputs(dsd)["train"].add_column("length", dsd["train"]["length"])
    collator = objectives.collator_for("sequence-classification", tokenizer)
    states = sum(autobatch.state_bytes_predicted(model, "adamw_torch").values())
    act = {m: memory.activation_bytes(model, collator([ds[i] for i in autobatch.longest_rows(ds, m)]),
                                       classification_loss) for m in (8, 16)}
    # A budget whose usable 90% lies between the 8-row and the 16-row step.
    budget = int((states + (act[8] + act[16]) / 2) / autobatch.SAFETY)
    rng = torch.get_rng_state()
    micro, probes = autobatch.find_micro_batch(model, ds, collator, classification_loss, 32, budget,
                                               "adamw_torch", "cpu")
    assert micro == 8
    assert [p.micro_batch for p in probes] == [32, 16, 8]
    assert [p.fits for p in probes] == [False, False, True]
    assert probes[-1].peak_bytes == states + act[8]
    assert torch.equal(rng, torch.get_rng_state())  # the probes leave the run's RNG alone
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(UserError, match="not even a micro-batch of 1"):
        autobatch.find_micro_batch(model, ds, collator, classification_loss, 32, states // 2, "adamw_torch", "cpu")
    # What the run keeps beside the model (a DPO reference copy) counts in every probe: 8 no longer fits.
    kept = act[16] - act[8]
    micro, probes = autobatch.find_micro_batch(model, ds, collator, classification_loss, 32, budget,
                                               "adamw_torch", "cpu", extra_bytes=kept)
    assert micro < 8 and probes[2].peak_bytes == states + act[8] + kept


def test_under_fsdp2_the_finder_counts_one_ranks_shards_for_each_micro_batch(tokenizer, dsd):
    """``states_at`` (train.fsdp: :func:`onegpu.training.parallel.sharding.per_rank_bytes` of the accumulation each
    micro-batch
    implies): each probe is its activations plus one rank's params, gradients and optimizer states and the weights
    it gathers, never the whole model's. A budget that the whole model's states overflow at a micro-batch of 8 holds
    it on each of 2 ranks (16 examples a step: accumulation 1, the gradients sharded), where the whole model's states
    alone did not fit (refused before); at 4 (accumulation 2) a rank holds whole gradients, which the probe counts."""
    from onegpu.training.parallel import sharding
    model = tiny_bert(tokenizer)
    ds = objectives.model_inputs(dsd)["train"].add_column("length", dsd["train"]["length"])
    collator = objectives.collator_for("sequence-classification", tokenizer)
    act = {m: memory.activation_bytes(model, collator([ds[i] for i in autobatch.longest_rows(ds, m)]),
                                       classification_loss) for m in (8, 4)}

    def at(m: int) -> dict:
        return sharding.per_rank_bytes(model, 2, 16 // (m * 2), "adamw_torch")
    whole = sum(autobatch.state_bytes_predicted(model, "adamw_torch").values())
    budget = int((sum(at(8).values()) + act[8]) / autobatch.SAFETY) + 1
    assert whole + act[8] > budget * autobatch.SAFETY  # unsharded, 8 would not fit
    micro, probes = autobatch.find_micro_batch(model, ds, collator, classification_loss, 16, budget, "adamw_torch",
                                               "cpu", world_size=2, states_at=at)
    assert (micro, [p.micro_batch for p in probes]) == (8, [8])
    assert (probes[0].peak_bytes, probes[0].how) == (sum(at(8).values()) + act[8], "breakdown, one rank's shards")
    whole_grads = autobatch.state_bytes_predicted(model, "adamw_torch")["mem_grads_bytes"]
    assert at(4)["mem_grads_bytes"] == whole_grads > at(8)["mem_grads_bytes"]  # whole while accumulating
    with pytest.raises(UserError, match="not even a micro-batch of 1 fits"):  # the whole model's states alone
        autobatch.find_micro_batch(model, ds, collator, classification_loss, 16, budget, "adamw_torch", "cpu",
                                   world_size=2)


def test_budget_is_required_on_cpu():
    with pytest.raises(ConfigError, match="train.memory_budget_gib"):
        autobatch.budget_bytes(None, "cpu")
    assert autobatch.budget_bytes(0.5, "cpu") == 2**29


def _losses(tokenizer, dsd, cfg, injector=None, backend=hf_trainer):
    rows = []
    model, steps = backend.train(TrainRequest(tiny_bert(tokenizer), tokenizer, dsd, cfg,
                                              sink=lambda m, s: "loss" in m and rows.append((s, m["loss"])),
                                              oom_injector=injector))
    return [loss for _, loss in sorted(rows)], steps


@BACKENDS
def test_injected_out_of_memory_is_survived_with_the_same_losses(tokenizer, dsd, tmp_path, monkeypatch, backend):
    monkeypatch.chdir(tmp_path)
    # Step 2's micro-batches of 4 rows "do not fit": the step is redone as 2 x 4, and so are later steps.
    injector = lambda step, rows: step == 2 and rows > 2  # noqa: E731
    survived, steps = _losses(tokenizer, dsd, cfg_for(4, 2), injector, backend)
    reference, _ = _losses(tokenizer, dsd, cfg_for(2, 4), backend=backend)
    assert len(survived) == len(reference) == 3
    assert max(abs(a - b) for a, b in zip(survived, reference)) < 1e-5, (survived, reference)
    assert steps.events == [{"step": 2, "old": "4 x 2", "new": "2 x 4", "micro_batch": 2}]
    assert [r["samples"] for r in steps.rows] == [8, 8, 8]  # redone pieces are not counted twice


@BACKENDS
def test_out_of_memory_without_a_smaller_split_fails_clearly(tokenizer, dsd, tmp_path, monkeypatch, backend):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match="no smaller split is left"):
        _losses(tokenizer, dsd, cfg_for(2, 4), lambda step, rows: True, backend)


@BACKENDS
def test_oom_retry_off_reraises(tokenizer, dsd, tmp_path, monkeypatch, backend):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(torch.OutOfMemoryError):
        _losses(tokenizer, dsd, cfg_for(4, 2, oom_retry=False), lambda step, rows: step == 1, backend)


def test_estimate_predicts_measured_activation_bytes_within_15_percent(tokenizer):
    """The default model at max_length 64: predicted from 1- and 2-row probes, measured on 8 real rows."""
    from onegpu.training.objectives.loss import classification_loss as loss_fn
    model = loader.build_classifier(loader.resolve_model_path("packaged:all-MiniLM-L6-v2"), LABELS, None)
    texts = [" ".join(f"word{j}" for j in range(n)) for n in (80, 120, 70, 90, 200, 66, 75, 100)]
    ds = Dataset.from_dict({"text": texts, "label": [0, 1, 2, 0, 1, 2, 0, 1]})
    enc = tokenizer(texts, truncation=True, max_length=64)
    ds = ds.add_column("input_ids", enc["input_ids"]).add_column("attention_mask", enc["attention_mask"])
    ds = ds.add_column("token_type_ids", enc["token_type_ids"])
    ds = ds.add_column("length", [len(x) for x in enc["input_ids"]])
    rows = ds.rename_column("label", "labels").remove_columns("text")
    collator = objectives.collator_for("sequence-classification", tokenizer)
    est = autobatch.estimate(model, rows, collator, loss_fn, [8], "adamw_torch", False, loader.enable_checkpointing)
    model.activation_checkpointing_disable()
    measured = memory.activation_bytes(model, collator([rows[i] for i in range(8)]), loss_fn)
    predicted = est["rows"][0]["activations"]
    assert abs(predicted - measured) / measured < 0.15, (predicted, measured)
    assert est["rows"][0]["activations_checkpointed"] * 3 < predicted
    s = est["states"]
    assert s["mem_grads_bytes"] == s["mem_params_bytes"] and s["mem_optimizer_bytes"] == 2 * s["mem_params_bytes"]


@pytest.mark.parametrize("optim", ["adafactor", "adamw_torch", "adamw_torch_fused"])
def test_optimizer_state_estimate_is_within_15_percent_of_the_measured_state(optim):
    """The estimate of ``onegpu estimate`` against the state the optimizer really holds after a step
    (:func:`onegpu.measure.memory.state_bytes`), including a 3-d parameter (Adafactor factors its last two dims)."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification
    from transformers.optimization import Adafactor
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(vocab_size=500, hidden_size=32, num_hidden_layers=2,
                                                     num_attention_heads=2, intermediate_size=64, num_labels=3))
    model.register_parameter("cube", torch.nn.Parameter(torch.randn(3, 5, 7)))
    if optim == "adafactor":
        opt = Adafactor(model.parameters(), lr=1e-3, scale_parameter=False, relative_step=False)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=optim.endswith("fused") or None)
    out = model(input_ids=torch.randint(0, 500, (4, 9)), labels=torch.tensor([0, 1, 2, 0]))
    (out.loss + model.cube.sum()).backward()
    opt.step()
    measured = memory.state_bytes(model, opt)["mem_optimizer_bytes"]
    predicted = autobatch.state_bytes_predicted(model, optim)["mem_optimizer_bytes"]
    assert abs(predicted - measured) <= 0.15 * measured, (predicted, measured)
    params = memory.state_bytes(model, opt)["mem_params_bytes"]
    assert (measured < 0.1 * params) if optim == "adafactor" else measured == 2 * params



@pytest.mark.parametrize("optim,most", [("adamw_torch_8bit", 0.35), ("adamw_torch_4bit", 0.2)])
def test_torchao_low_bit_estimate_equals_the_measured_state(optim, most):
    """torchao's AdamW8bit/AdamW4bit after a real step (memory.state_bytes): the estimate is exact, byte for
    byte, on a 256x256 + 256x64 Linear stack whose biases (below 4,096 elements) stay fp32; and at most 0.35x
    (8-bit: 0.26x) / 0.2x (4-bit: 0.13x) of fp32 AdamW's 2 x 4 bytes per parameter."""
    pytest.importorskip("torchao")
    from tests.unit.tiny import low_bit_step
    model, opt = low_bit_step(optim)
    measured = memory.state_bytes(model, opt)["mem_optimizer_bytes"]
    assert autobatch.state_bytes_predicted(model, optim)["mem_optimizer_bytes"] == measured
    fp32 = autobatch.optimizer_state_bytes(model, "adamw_torch")
    assert fp32 == 8 * sum(p.numel() for p in model.parameters()) == 657920
    assert measured <= most * fp32, measured / fp32


def test_finder_probes_under_the_trainings_bf16_autocast(tokenizer, dsd):
    """With train.bf16 the step's activations are the bf16 autocast ones (2-byte matmul outputs), as the
    training saves them: the finder's breakdown uses those, so a budget that fits a bf16 step of 16 rows
    but not an fp32 one picks 16 under bf16 and 8 in fp32."""
    model = tiny_bert(tokenizer)
    ds = objectives.model_inputs(dsd)["train"].add_column("length", dsd["train"]["length"])
    collator = objectives.collator_for("sequence-classification", tokenizer)
    states = sum(autobatch.state_bytes_predicted(model, "adamw_torch").values())
    rows16 = collator([ds[i] for i in autobatch.longest_rows(ds, 16)])
    fp32 = memory.activation_bytes(model, rows16, classification_loss)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        saved = memory.saved_bytes(model, rows16, classification_loss)
    assert saved["activations"] < 0.8 * fp32
    bf16 = sum(saved.values())  # + the weight copies autocast keeps: real memory of the step
    budget = int((states + (bf16 + fp32) / 2) / autobatch.SAFETY)
    micro, probes = autobatch.find_micro_batch(model, ds, collator, classification_loss, 32, budget,
                                               "adamw_torch", "cpu", mixed_precision="bf16")
    assert micro == 16 and probes[-1].peak_bytes == states + bf16, probes
    assert autobatch.find_micro_batch(model, ds, collator, classification_loss, 32, budget,
                                      "adamw_torch", "cpu")[0] == 8


def test_the_offloading_line_names_the_activations_each_micro_batch_moves_off_the_device():
    est = {"rows": [{"micro_batch": 2, "activations": 3 * 2**20, "activations_checkpointed": 2**20},
                    {"micro_batch": 4, "activations": 6 * 2**20, "activations_checkpointed": 2 * 2**20}]}
    line = autobatch.offloading_line(est, checkpointing=False)
    assert line.startswith("train.activation_offloading: the activations move to pinned host memory")
    assert "3 MiB at 2, 6 MiB at 4" in line
    assert "1 MiB at 2, 2 MiB at 4" in autobatch.offloading_line(est, checkpointing=True)


def test_a_validation_passs_term_is_the_whole_logits_or_one_fused_tile():
    """autobatch.validation_term for 5 rows like a probe of 12 positions (7 targets): the whole logits'
    bytes per row (logits, their float32 copy, their log-softmax) x 5, or under the fused head one tile of
    the 35 targets (lm_head.eval_transient_bytes); what ``onegpu estimate``'s validation line adds."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from onegpu.training.objectives import lm_head
    model = GPT2LMHeadModel(GPT2Config(vocab_size=300, n_embd=32, n_layer=1, n_head=2, n_positions=64))
    labels = torch.arange(12)[None]
    labels[:, :5] = -100
    probe = {"input_ids": torch.arange(12)[None], "labels": labels}
    assert autobatch.validation_term(model, probe, 5) == 5 * 12 * 300 * (4 + 4 + 4)
    lm_head.attach(model)
    assert autobatch.validation_term(model, probe, 5) == lm_head.eval_transient_bytes(5 * 7, 300, 32)
    assert lm_head.eval_transient_bytes(30, 300, 32) == 2 * 4 * 32 * 300 + 4 * 30 * 32  # 30 targets: 32 rows

