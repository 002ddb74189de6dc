"""PEFT LoRA (``model.lora``): config, both backends, checkpointing, what trains, saving, key, estimate.

Tiny models on CPU: the 2-layer BERT classifier of ``tests/unit/tiny.py`` and a 1-layer GPT-2 built from params.
"""
from __future__ import annotations

import importlib
import types
import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from onegpu.config import Resolved, from_container  # noqa: E402
from onegpu.equivalence import equivalence_key  # noqa: E402
from onegpu.errors import ConfigError  # noqa: E402
from onegpu.measure import memory  # noqa: E402
from onegpu.models import loader, lora  # noqa: E402
from onegpu.training.memory import autobatch  # noqa: E402
from onegpu.training.backends.base import TrainRequest  # noqa: E402
from tests import defaults  # noqa: E402
from tests.unit.tiny import LOSS_TOL, NORM_TOL, dataset, interrupt_at_step_2, tiny_bert, tokenizer  # noqa: E402

LORA = {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["query", "value"]}


def _cfg(backend="accelerate", checkpointing=False, lora_cfg=LORA, max_steps=3, lr=1e-2, micro=4, accum=2,
         **model):
    return from_container({
        "model": {"dropout": 0.0, "lora": lora_cfg, **model},
        "train": {"backend": backend, "per_device_train_batch_size": micro, "gradient_accumulation_steps": accum,
                  "max_steps": max_steps, "learning_rate": lr, "seed": 7, "gradient_checkpointing": checkpointing,
                  "logging_steps": 100}}, source="test")


def _train(cfg, model, tok, dsd):
    from onegpu.training.backends import base
    module = importlib.import_module(base.REGISTRY[cfg.train.backend])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return module.train(base.TrainRequest(model, tok, dsd, cfg, sink=lambda m, s: None))


def _lora_bert(cfg):
    return lora.apply(tiny_bert(), cfg.model.lora, cfg.model.task, cfg.train.gradient_checkpointing)


def _losses(rows):
    return [r["loss"] for r in rows]


# -- config ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad,key", [
    ({"r": -1}, "model.lora.r"), ({"r": "x"}, "model.lora.r"), ({"alpha": 0}, "model.lora.alpha"),
    ({"dropout": 1.0}, "model.lora.dropout"), ({"dropout": -0.1}, "model.lora.dropout"),
    ({"target_modules": []}, "model.lora.target_modules"), ({"target_modules": "query"}, "model.lora.target_modules"),
    ({"rank": 4}, "model.lora.rank"), (5, "model.lora"), ([4], "model.lora"),
])
def test_bad_lora_values_give_one_line_naming_the_key(bad, key):
    with pytest.raises(ConfigError) as e:
        from_container({"model": {"lora": bad}}, source="params.yaml")
    msg = str(e.value)
    assert msg.startswith(f"params.yaml: {key}") or f"'{key}'" in msg, msg
    assert "\n" not in msg


def test_lora_defaults_and_override():
    from onegpu.config import apply_override
    assert from_container({}).model.lora is None
    raw = {"model": {"lora": None}}
    apply_override(raw, "model.lora.r=16")
    got = from_container(raw).model.lora
    assert (got.r, got.alpha, got.dropout, got.target_modules) == (16, 16.0, 0.0, None)


def test_params_yaml_has_the_lora_mapping_off_so_the_dotted_override_turns_it_on():
    """`dvc exp run -S model.lora.r=8` sets a key of the mapping params.yaml holds (DVC cannot add a key
    under a null: "Key 'r' is not in struct"); r: 0 is full fine-tuning."""
    from onegpu.config import apply_override
    raw = defaults.params()
    assert raw["model"]["lora"] == {"r": 0, "alpha": 16, "dropout": 0.0, "target_modules": None}
    assert from_container(raw).model.lora_adapters is None
    apply_override(raw, "model.lora.r=8")
    got = from_container(raw).model.lora_adapters
    assert (got.r, got.alpha, got.dropout, got.target_modules) == (8, 16.0, 0.0, None)
    for whole in ("model.lora={r: 8}", "model.lora={r: 8, alpha: 16}"):  # the whole mapping still works
        raw = defaults.params()
        apply_override(raw, whole)
        assert from_container(raw).model.lora_adapters == got, whole


def test_lora_is_in_the_equivalence_key_and_off_adds_nothing():
    layout = Resolved(8, 1, 1)
    off = equivalence_key(from_container({}), layout)
    assert equivalence_key(from_container({"model": {"lora": None}}), layout) == off
    for r0 in ({"r": 0}, {"r": 0, "alpha": 32, "dropout": 0.1, "target_modules": ["query"]}):
        assert equivalence_key(from_container({"model": {"lora": r0}}), layout) == off, r0
    on = equivalence_key(from_container({"model": {"lora": {"r": 4}}}), layout)
    assert on != off
    assert equivalence_key(from_container({"model": {"lora": {"r": 8}}}), layout) != on
    assert equivalence_key(from_container({"model": {"lora": {"r": 4, "dropout": 0.1}}}), layout) != on


# -- training ----------------------------------------------------------------------------------------

def test_lora_takes_the_same_steps_on_both_backends_and_only_adapters_and_head_change():
    runs = {}
    for backend in ("trainer", "accelerate"):
        cfg = _cfg(backend)
        model = _lora_bert(cfg)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        trained, steps = _train(cfg, model, tokenizer(), dataset(24))
        after = dict(trained.named_parameters())
        changed = {n for n in before if not torch.equal(before[n], after[n].detach())}
        trainable = {n for n, p in after.items() if p.requires_grad}
        assert changed and changed <= trainable, sorted(changed - trainable)[:3]
        assert all("lora_" in n or "classifier.modules_to_save" in n for n in trainable), sorted(trainable)
        assert any("classifier.modules_to_save" in n for n in changed)  # the new head trains
        assert any("lora_B" in n for n in changed)
        runs[backend] = steps.rows
    hf, acc = runs["trainer"], runs["accelerate"]
    assert [r["step"] for r in hf] == [r["step"] for r in acc] == [1, 2, 3]
    assert max(abs(a - b) for a, b in zip(_losses(hf), _losses(acc))) <= LOSS_TOL, (_losses(hf), _losses(acc))
    assert max(abs(a["grad_norm"] - b["grad_norm"]) for a, b in zip(hf, acc)) <= NORM_TOL


def test_state_bytes_count_trainable_parameters_only_and_the_estimate_matches():
    cfg = _cfg("accelerate", max_steps=1)
    model = _lora_bert(cfg)
    trainable = lora.trainable_parameters(model)
    total = sum(p.numel() for p in model.parameters())
    assert 0 < trainable < total / 10
    predicted = autobatch.state_bytes_predicted(model, "adamw_torch")
    from onegpu.training.backends.accelerate import make_optimizer
    opt = make_optimizer(model, cfg)
    from onegpu.training.objectives import collator_for, model_inputs
    rows = model_inputs(dataset(8))["train"]
    batch = collator_for("sequence-classification", tokenizer())([rows[i] for i in range(8)])
    model(**batch).loss.backward()
    opt.step()
    measured = memory.state_bytes(model, opt)
    assert measured["mem_grads_bytes"] == 4 * trainable
    assert measured["mem_optimizer_bytes"] == 2 * 4 * trainable  # AdamW: exp_avg + exp_avg_sq in fp32
    for k in measured:
        assert predicted[k] == pytest.approx(measured[k], rel=0.15), (k, predicted[k], measured[k])


@pytest.mark.parametrize("backend", ["accelerate", "trainer"])
def test_lora_with_checkpointing_trains_the_classifier(backend):
    # 8 rows, one micro-batch of 8: every step sees the same batch, so the loss must fall.
    base = _cfg(backend, micro=8, accum=1, max_steps=8, lr=0.1)
    plain = _train(base, _lora_bert(base), tokenizer(), dataset(8))[1].rows
    cfg = _cfg(backend, checkpointing=True, micro=8, accum=1, max_steps=8, lr=0.1)
    _, steps = _train(cfg, _lora_bert(cfg), tokenizer(), dataset(8))
    losses = _losses(steps.rows)
    assert losses[-1] < losses[0] - 0.05, losses
    assert max(abs(a - b) for a, b in zip(losses, _losses(plain))) <= LOSS_TOL  # checkpointing: same steps


def _tiny_gpt2_data():
    from datasets import ClassLabel, Dataset, DatasetDict
    texts = [" ".join(f"w{(i * 7 + j) % 50}" for j in range(5 + (i * 5) % 23)) for i in range(8)]
    tok = loader.train_bpe_tokenizer(texts, 300)
    ds = Dataset.from_dict({"text": texts, "label": ["x"] * 8}).cast_column("label", ClassLabel(names=["x"]))
    dsd = DatasetDict(train=ds).map(
        lambda b: tok([t + tok.eos_token for t in b["text"]], truncation=True, max_length=32), batched=True)
    return tok, dsd


@pytest.mark.parametrize("backend", ["accelerate", "trainer"])
def test_lora_with_checkpointing_trains_the_causal_lm(backend):
    tok, dsd = _tiny_gpt2_data()
    cfg = _cfg(backend, checkpointing=True, micro=8, accum=1, max_steps=4, lr=5e-2,
               lora_cfg={"r": 4, "alpha": 8, "target_modules": None}, task="causal-lm", name_or_path=None,
               n_layer=1, n_embd=32, n_head=2, vocab_size=300)
    torch.manual_seed(0)
    model = lora.apply(loader.build_causal_lm(None, tok, cfg.model, 32, 0.0), cfg.model.lora, "causal-lm", True)
    assert {n.split(".")[-3] for n, p in model.named_parameters() if p.requires_grad} == {"lora_A", "lora_B"}
    assert any("c_attn.lora_A" in n for n, _ in model.named_parameters())  # peft's GPT-2 default target
    _, steps = _train(cfg, model, tok, dsd)
    losses = _losses(steps.rows)
    assert losses[-1] < losses[0] - 0.05, losses


def test_checkpointing_makes_the_frozen_embedding_output_require_grad():
    """The plain PEFT failure: with frozen embeddings, the input of the first checkpointed block does not
    require grad. ``lora.apply(checkpointing=True)`` makes it (``enable_input_require_grads``)."""
    seen = {}
    for on in (False, True):
        model = _lora_bert(_cfg(checkpointing=on))
        model.get_input_embeddings().register_forward_hook(lambda m, i, o, on=on: seen.setdefault(on, o.requires_grad))
        model.train()
        model(**tokenizer()(["a market text"], return_tensors="pt"))
    assert seen == {False: False, True: True}


def test_lora_under_reentrant_checkpointing_gets_gradients():
    cfg = _cfg(checkpointing=True)
    model = _lora_bert(cfg)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.train()
    batch = tokenizer()(["a market text", "the team won"], return_tensors="pt", padding=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model(**batch, labels=torch.tensor([0, 1])).loss.backward()
    grads = [p.grad for n, p in model.named_parameters() if "layer.0." in n and "lora_B" in n]  # B starts at 0
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads)


def test_describe_counts_trainable_parameters():
    cfg = _cfg()
    tags = loader.describe(_lora_bert(cfg))
    assert int(tags["model.trainable_parameters"]) == lora.trainable_parameters(_lora_bert(cfg))
    assert int(tags["model.trainable_parameters"]) < int(tags["model.parameters"]) / 10
    plain = loader.describe(tiny_bert())
    assert plain["model.trainable_parameters"] == plain["model.parameters"]


# -- saving ------------------------------------------------------------------------------------------

def test_train_stage_saves_adapter_and_merged_model_that_evaluate_the_same(tmp_path, monkeypatch):
    from peft import PeftModel

    from onegpu import evaluation, paths
    from onegpu.stages import train as train_stage
    monkeypatch.chdir(tmp_path)
    cfg = _cfg("accelerate", lora_cfg={**LORA, "dropout": 0.1})
    model, steps = _train(cfg, _lora_bert(cfg), tokenizer(), dataset(24))
    from onegpu.models import record
    spec = record.logged_model(cfg, "k", "lora-r4")
    result = types.SimpleNamespace(model=model, tokenizer=tokenizer(), steps=steps, summary={"train_loss": 1.0},
                                   run_id="r", experiment_id="e", plan=types.SimpleNamespace(key="k"),
                                   saved_config={}, outside_load=None, model_spec=spec)
    train_stage._write_outputs(result)
    assert (paths.ADAPTER_DIR / "adapter_config.json").is_file()
    # the run file keeps the logged model for evaluate: it names the adapter and the base
    kept = paths.read_json(paths.RUN_FILE)["logged_model"]
    assert kept["tags"][record.ADAPTER_TAG] == "models/adapter" and kept["params"]["finetuning"] == "lora"
    merged, tok = loader.load_trained(paths.MODEL_DIR)
    assert type(merged).__name__ == "BertForSequenceClassification"
    assert not any("lora" in n for n, _ in merged.named_parameters())
    adapter = PeftModel.from_pretrained(tiny_bert(), str(paths.ADAPTER_DIR))
    data = dataset(24)["train"]
    m_merged, _, pred_merged = evaluation.classifier_metrics(merged, tok, data, cfg)
    m_adapter, _, pred_adapter = evaluation.classifier_metrics(adapter, tok, data, cfg)
    assert m_merged["test_loss"] == pytest.approx(m_adapter["test_loss"], abs=1e-5)
    assert pred_merged == pred_adapter
    assert m_merged["test_accuracy"] == m_adapter["test_accuracy"]
    # and the adapter made a difference: the merged model is not the untrained base
    base, _, _ = evaluation.classifier_metrics(tiny_bert(), tok, data, cfg)
    assert abs(base["test_loss"] - m_merged["test_loss"]) > 1e-3


def test_full_fine_tuning_removes_a_stale_adapter(tmp_path, monkeypatch):
    from onegpu import paths
    from onegpu.stages import train as train_stage
    monkeypatch.chdir(tmp_path)
    (tmp_path / paths.ADAPTER_DIR).mkdir(parents=True)
    (tmp_path / paths.ADAPTER_DIR / "adapter_config.json").write_text("{}")
    result = types.SimpleNamespace(model=tiny_bert(), tokenizer=tokenizer(), steps=types.SimpleNamespace(rows=[], evals=[]),
                                   summary={}, run_id="r", experiment_id="e", plan=types.SimpleNamespace(key="k"),
                                   saved_config={}, outside_load=None, model_spec=None)
    train_stage._write_outputs(result)
    assert not (tmp_path / paths.ADAPTER_DIR).exists()
    assert "logged_model" not in paths.read_json(paths.RUN_FILE)
    assert (tmp_path / paths.MODEL_DIR / "config.json").is_file()


def test_unknown_target_module_is_one_model_error():
    from onegpu.errors import ModelError
    cfg = _cfg(lora_cfg={"r": 2, "target_modules": ["nope"]})
    with pytest.raises(ModelError, match=r"model.lora.target_modules=\['nope'\].*query"):
        _lora_bert(cfg)


# -- resume ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["accelerate", "trainer"])
def test_interrupted_lora_run_resumes_to_the_uninterrupted_losses_and_weights(backend, tmp_path, monkeypatch):
    """Stop after optimizer step 2 of 5, resume from the checkpoint in a fresh model: the same per-step
    losses and the same adapter and head weights as one uninterrupted run. Dropout on the model and in
    the adapters, so the RNG state must resume too; the resumed model is built anew (its adapters'
    ``A`` drawn again from a seed), so the checkpoint must restore them."""
    from onegpu.training.backends import base
    monkeypatch.chdir(tmp_path)
    module = importlib.import_module(base.REGISTRY[backend])
    cfg = _cfg(backend, lora_cfg={**LORA, "dropout": 0.1}, max_steps=5, lr=1e-2, dropout=0.1)

    def build(seed):
        model = tiny_bert()
        model.config.hidden_dropout_prob = model.config.attention_probs_dropout_prob = 0.1
        from transformers import BertForSequenceClassification
        torch.manual_seed(0)
        model = BertForSequenceClassification(model.config)
        torch.manual_seed(seed)
        return lora.apply(model, cfg.model.lora, cfg.model.task)

    def train(model, sink, **kw):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return module.train(TrainRequest(model, tokenizer(), dataset(24), cfg, sink, **kw))

    ref = []
    ref_model, _ = train(build(1), lambda m, s: ref.append(m["loss"]))
    ckpt = tmp_path / "ckpt"
    first, resume = interrupt_at_step_2(lambda sink, **kw: train(build(1), sink, **kw), ckpt)
    # Both backends check for a stop once the step is logged (after its validation pass): step 2.
    assert resume is not None and resume.step == 2
    rest = []
    model, rec = train(build(2), lambda m, s: rest.append(m["loss"]), checkpoint_dir=ckpt, resume=resume)
    assert len(ref) == 5 and first[:resume.step] + rest == pytest.approx(ref, abs=1e-6), (first, rest, ref)
    assert [r["step"] for r in rec.rows] == [1, 2, 3, 4, 5]
    want = ref_model.state_dict()
    got = model.state_dict()
    assert set(got) == set(want)
    assert max(float((v - want[k]).abs().max()) for k, v in got.items()) <= 1e-6
    assert lora.is_peft(model)
def test_apply_shows_the_user_no_deprecation_warning_meant_for_peft():
    """peft 0.21 reads transformers 5's deprecated ``is_gradient_checkpointing``; its FutureWarning named
    no setting of the user's and showed in every LoRA training's output."""
    import warnings

    from transformers import BertConfig, BertForSequenceClassification

    from onegpu import config
    from onegpu.models import lora
    model = BertForSequenceClassification(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                                     intermediate_size=64, vocab_size=100))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        wrapped = lora.apply(model, config.LoraConfig(), "sequence-classification", True)
    assert sum(p.numel() for p in wrapped.parameters() if p.requires_grad) > 0
