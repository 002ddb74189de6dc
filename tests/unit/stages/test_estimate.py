"""``onegpu estimate`` per knob against what a real short training run measures.

For each knob (bf16 on CPU, eager and SDPA attention, Adafactor, LoRA, activation checkpointing) the
estimate's params, grads, optimizer states and activations of one micro-batch must be within 15% of the
run's logged ``mem_*_bytes`` (the ``accelerate`` backend, and bf16 also on ``trainer``; one optimizer
step). Rows all have the same length (truncated at ``max_length``), so the estimate's longest-row probe
and the run's first-rows probe see the same padded shape. Tiny 2-layer BERT of ``tests/unit/tiny.py``.
"""
from __future__ import annotations

import functools
import importlib
import json
import warnings

import pytest

torch = pytest.importorskip("torch")

from onegpu.config import from_container  # noqa: E402
from onegpu.models import lora  # noqa: E402
from onegpu.training.memory import autobatch, checkpointing  # noqa: E402
from onegpu.training.objectives import collator_for, model_inputs  # noqa: E402
from onegpu.training.objectives.loss import classification_loss  # noqa: E402
from tests.unit.tiny import WORDS, tiny_bert, tokenizer  # noqa: E402

MICRO = 4
KEYS = ("mem_params_bytes", "mem_grads_bytes", "mem_optimizer_bytes", "mem_activation_bytes",
        "mem_autocast_weights_bytes")
KNOBS = {
    "fp32": {},
    "bf16": {"train": {"bf16": True}},
    "bf16-trainer": {"train": {"bf16": True, "backend": "trainer"}},  # Trainer's own autocast path
    "eager": {"model": {"attn_implementation": "eager"}},
    "sdpa": {"model": {"attn_implementation": "sdpa"}},
    "adafactor": {"train": {"optim": "adafactor"}},
    "lora": {"model": {"lora": {"r": 4, "alpha": 8, "target_modules": ["query", "value"]}}},
    "checkpointing": {"train": {"gradient_checkpointing": True}},
}


@pytest.fixture(autouse=True)
def _fresh_accelerator_state():
    """Accelerate keeps one process-wide state whose ``mixed_precision`` cannot change once set; a bf16
    run after an fp32 one (or the other way round) in one pytest process needs it reset."""
    from accelerate.state import AcceleratorState
    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


@functools.cache
def _uniform_rows(n: int = 8):
    """``n`` texts of 40+ words, all truncated to 32 tokens: one padded length for every probe."""
    from datasets import ClassLabel, Dataset, DatasetDict

    from onegpu.data import tokenize
    texts = [" ".join((WORDS * 3)[i:i + 40]) for i in range(n)]
    ds = Dataset.from_dict({"text": texts, "label": [i % 3 for i in range(n)]}).cast_column(
        "label", ClassLabel(names=["business", "entertainment", "sport"]))
    dsd = tokenize(DatasetDict(train=ds), tokenizer(), max_length=32)
    assert set(dsd["train"]["length"]) == {32}
    return dsd


def _cfg(knob: str):
    over = KNOBS[knob]
    return from_container({
        "model": {"dropout": 0.0, **over.get("model", {})},
        "train": {"backend": "accelerate", "per_device_train_batch_size": MICRO, "gradient_accumulation_steps": 1,
                  "max_steps": 1, "learning_rate": 1e-3, "seed": 7, "logging_steps": 100, **over.get("train", {})}},
        source="test")


def _model(cfg):
    """The model as the estimate stage and the train stage build it: attention kernel, then LoRA."""
    model = tiny_bert(cfg.model.attn_implementation)
    if cfg.model.lora is not None:
        model = lora.apply(model, cfg.model.lora, cfg.model.task, cfg.train.gradient_checkpointing)
    return model


@functools.cache
def estimated_and_measured(knob: str) -> tuple[dict, dict]:
    """(the estimate for one micro-batch of ``MICRO`` rows, the run's memory breakdown), bytes."""
    cfg = _cfg(knob)
    dsd = _uniform_rows()
    rows = model_inputs(dsd)["train"].add_column("length", dsd["train"]["length"])
    est = autobatch.estimate(_model(cfg), rows, collator_for("sequence-classification", tokenizer()),
                             classification_loss, [MICRO], cfg.train.optim, cfg.train.gradient_checkpointing,
                             lambda m: checkpointing.enable(m, cfg.train), mixed_precision=cfg.train.mixed_precision)
    row = est["rows"][0]
    predicted = {**est["states"], "mem_activation_bytes":
                 row["activations_checkpointed" if cfg.train.gradient_checkpointing else "activations"],
                 "mem_autocast_weights_bytes": est["autocast_weights"]}
    from accelerate.state import AcceleratorState
    AcceleratorState._reset_state(reset_partial_state=True)
    from onegpu.training.backends import base
    backend = importlib.import_module(base.REGISTRY[cfg.train.backend])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, steps = backend.train(base.TrainRequest(_model(cfg), tokenizer(), dsd, cfg, sink=lambda m, s: None))
    return predicted, {k: steps.breakdown[k] for k in KEYS}


@pytest.mark.parametrize("knob", list(KNOBS))
def test_estimate_is_within_15_percent_of_the_measured_breakdown(knob):
    predicted, measured = estimated_and_measured(knob)
    for k in KEYS:
        assert predicted[k] == pytest.approx(measured[k], rel=0.15), (k, predicted, measured)


def test_estimate_sees_what_each_knob_changes():
    """The knobs move the measured figures, and the estimate moves the same way: bf16 autocast saves
    2-byte activations, eager attention keeps the attention probabilities SDPA does not, Adafactor keeps
    factored moments, LoRA keeps grads and states for the adapters and head only, checkpointing keeps
    the layer inputs only."""
    est = {k: estimated_and_measured(k)[0] for k in KNOBS}
    got = {k: estimated_and_measured(k)[1] for k in KNOBS}
    for figures in (est, got):
        act = {k: v["mem_activation_bytes"] for k, v in figures.items()}
        assert act["bf16"] < 0.8 * act["fp32"] and act["checkpointing"] < 0.5 * act["fp32"], act
        assert act["eager"] > act["sdpa"] == act["fp32"], act  # tiny_bert's default kernel is SDPA
        assert figures["adafactor"]["mem_optimizer_bytes"] < 0.2 * figures["fp32"]["mem_optimizer_bytes"]
        assert figures["lora"]["mem_grads_bytes"] < 0.2 * figures["fp32"]["mem_grads_bytes"]
        # bf16 autocast's 2-byte weight copies: their own line, 0 in fp32
        assert figures["fp32"]["mem_autocast_weights_bytes"] == 0 < figures["bf16"]["mem_autocast_weights_bytes"]
    # The eager-minus-SDPA difference (the attention probabilities) is itself predicted within 15%.
    diff = lambda f: f["eager"]["mem_activation_bytes"] - f["sdpa"]["mem_activation_bytes"]  # noqa: E731
    assert diff(est) == pytest.approx(diff(got), rel=0.15), (diff(est), diff(got))


def test_estimate_stage_says_which_precision_and_attention_it_estimated_for(monkeypatch, capsys):
    """The stage runs the probes under the configured autocast and names precision, attention kernel,
    optimizer and LoRA in its header (model building and data reading replaced by the tiny ones)."""
    from onegpu.models import loader
    from onegpu.stages import estimate as stage
    dsd = _uniform_rows()
    monkeypatch.setattr(stage, "_rows", lambda cfg, path: (dsd, tokenizer(), "test rows"))
    monkeypatch.setattr(loader, "build_classifier", lambda path, labels, dropout, attn: tiny_bert(attn))
    cfg = from_container({"model": {"attn_implementation": "eager", "lora": {"r": 4, "target_modules": ["query"]}},
                          "train": {"bf16": True, "optim": "adafactor"}}, source="test")
    est = stage.run(cfg, [MICRO])
    head = capsys.readouterr().out.splitlines()[0]
    assert "precision bf16 autocast, attention eager, optimizer adafactor, LoRA r=4" in head, head
    fp32 = stage.run(from_container({"model": {"attn_implementation": "eager", "lora": {"r": 4, "target_modules":
                                                                                        ["query"]}},
                                     "train": {"optim": "adafactor"}}, source="test"), [MICRO])
    assert "precision fp32, attention eager" in capsys.readouterr().out.splitlines()[0]
    assert est["rows"][0]["activations"] < 0.8 * fp32["rows"][0]["activations"]


@pytest.mark.parametrize("fmt", ["text", "prompt-completion"])
def test_without_prepared_data_the_estimate_sees_prepares_own_rows(tmp_path, monkeypatch, fmt):
    """Issue 31: the estimate's sample is prepare's reading, de-duplication and tokenization of the first
    rows (``pipeline.sample``), so each of its rows equals prepare's row for the same source row."""
    from onegpu import paths
    from onegpu.data import pipeline
    from onegpu.stages import estimate as stage
    from tests.unit.training.objectives import test_batches as tp
    monkeypatch.setattr(paths, "PROCESSED", tmp_path / "no-processed-data")
    if fmt == "text":
        cfg = from_container({"data": {"max_train_samples": None}}, source="test")  # bbcnews, packaged MiniLM
        maker, column = pipeline.tokenizer_maker(cfg), "text"
    else:
        rows = [{"prompt": f"Question {i}: " + "why " * (i % 7) + "?", "completion": f"Answer {i}"}
                for i in range(300)]
        source = tmp_path / "d.jsonl"
        source.write_text("".join(json.dumps(r) + "\n" for r in rows + rows[:5]))
        cfg = from_container({"data": {"source": str(source), "max_length": 48, "max_train_samples": None},
                              "model": {"task": "causal-lm", "name_or_path": None}}, source="test")
        tok = tp.tokenizer()
        maker, column = (lambda texts: tok), "prompt"
        monkeypatch.setattr(pipeline, "tokenizer_maker", lambda cfg: maker)
    dsd, _, where = stage._rows(cfg, None)
    assert len(dsd["train"]) == stage.SAMPLE_ROWS and where.endswith(f"(first 256 rows, {fmt}, as prepare makes them)")
    sample, _ = pipeline.sample(cfg, fmt, maker, stage.SAMPLE_ROWS)
    assert dsd["train"].to_dict() == sample["train"].to_dict()
    prepared, _, _, _ = pipeline.prepare(cfg, fmt, maker)
    by_row = {r[column]: r for s in prepared.values() for r in s}
    assert prepared["train"].features["label"] == dsd["train"].features["label"]
    common = [r for r in dsd["train"] if r[column] in by_row]
    assert len(common) > 100
    for r in common:
        assert r == by_row[r[column]]  # the same ids, masks, labels, lengths (and prompt length, reference)


def test_the_estimate_says_what_a_validation_pass_adds_unless_the_run_does_not_validate(monkeypatch, capsys):
    """With ``train.eval_strategy`` on, one line: the pass's batches (evaluate.per_device_eval_batch_size
    rows, the split's longest length), its logits and loss, and params + optimizer states (the gradients
    are freed before it); none with ``eval_strategy: no``."""
    from onegpu.formatting import mib
    from onegpu.models import loader
    from onegpu.stages import estimate as stage
    dsd = _uniform_rows()
    monkeypatch.setattr(stage, "_rows", lambda cfg, path: (dsd, tokenizer(), "test rows"))
    monkeypatch.setattr(loader, "build_classifier", lambda path, labels, dropout, attn: tiny_bert(attn))
    est = stage.run(from_container({"evaluate": {"per_device_eval_batch_size": 5}}, source="test"), [MICRO])
    [line] = [x for x in capsys.readouterr().out.splitlines() if x.startswith("validation")]
    states = est["states"]["mem_params_bytes"] + est["states"]["mem_optimizer_bytes"]
    assert line.startswith("validation (train.eval_strategy: steps): a pass over batches of 5 rows up to 32 tokens "
                           "adds its logits and loss, 0 MiB, to the params and optimizer states"), line
    assert f": {mib(states)}, plus one layer's temporaries" in line
    stage.run(from_container({"train": {"eval_strategy": "no"}}, source="test"), [MICRO])
    assert not [x for x in capsys.readouterr().out.splitlines() if x.startswith("validation")]


def test_under_fsdp_the_estimate_is_per_rank_and_says_so(monkeypatch, capsys):
    """train.fsdp.enabled over 2 processes: one header line says the figures are per rank of 2 under FSDP2; the
    params, grads and optimizer states are one rank's dim-0 shards (onegpu.training.parallel.sharding.per_rank_bytes
    of the model the stage built), plus the gathered weights, in every total; the activations are the unsharded
    run's."""
    from onegpu.formatting import mib
    from onegpu.models import loader
    from onegpu.stages import estimate as stage
    from onegpu.training.parallel import sharding
    dsd = _uniform_rows()
    monkeypatch.setattr(stage, "_rows", lambda cfg, path: (dsd, tokenizer(), "test rows"))
    monkeypatch.setattr(loader, "build_classifier", lambda path, labels, dropout, attn: tiny_bert(attn))
    train = {"backend": "accelerate", "num_processes": 2, "eval_strategy": "no", "oom_retry": False,
             "gradient_accumulation_steps": 1}
    plain = stage.run(from_container({"train": train}, source="test"), [MICRO])
    capsys.readouterr()
    est = stage.run(from_container({"train": {**train, "fsdp": {"enabled": True}}}, source="test"), [MICRO])
    out = capsys.readouterr().out.splitlines()
    [line] = [x for x in out if x.startswith("per rank of 2 under FSDP2 sharding (train.fsdp.enabled), predicted")]
    assert "grads 1/2 each, reduce-scattered every step" in line and "every figure and total below is per rank" in line
    want = sharding.per_rank_bytes(tiny_bert(), 2, 1, "adamw_torch")
    assert est["states"] == {k: v for k, v in want.items() if k != "mem_gathered_bytes"}
    assert est["states"]["mem_params_bytes"] < 0.6 * plain["states"]["mem_params_bytes"]
    assert f"all-gathered weights {mib(want['mem_gathered_bytes'])}" in out[out.index(line) + 1]
    [p], [s] = plain["rows"], est["rows"]
    assert s["activations"] == p["activations"]
    assert s["total"] == p["total"] - sum(plain["states"].values()) + sum(want.values())
    accumulating = stage.run(from_container({"train": {**train, "gradient_accumulation_steps": 2,
                                                       "fsdp": {"enabled": True}}}, source="test"), [MICRO])
    assert accumulating["states"]["mem_grads_bytes"] == plain["states"]["mem_grads_bytes"]  # whole, unsharded
    assert "grads whole: gradient_accumulation_steps > 1 holds every gradient unsharded" in capsys.readouterr().out
