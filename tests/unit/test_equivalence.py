"""Equivalence logic on synthetic run records: verdicts, tolerances, causes, reference choice."""
from __future__ import annotations

import math

import pytest

from onegpu import equivalence as eq
from onegpu.equivalence import RunRecord

KEY = "0123456789abcdef"
STEPS = 8


def _loss(step: int) -> float:
    return 1.6 * math.exp(-0.15 * step) + 0.2


def record(name: str, micro: int, accum: int, *, ckpt: bool = False, loss=None, dropout: float = 0.0,
           batchnorm: int = 0, bf16: bool = False, device: str = "cpu", backend: str = "trainer",
           start: int = 0, key: str = KEY, mem: float = 1e9, sps: float = 100.0,
           evals: dict | None = None) -> RunRecord:
    loss = loss or [(s, _loss(s)) for s in range(1, STEPS + 1)]
    return RunRecord(
        run_id=f"id-{name}", name=name,
        params={"resolved.per_device_train_batch_size": str(micro),
                "resolved.gradient_accumulation_steps": str(accum),
                "resolved.effective_batch_size": str(micro * accum),
                "train.per_device_train_batch_size": str(micro),
                "train.gradient_accumulation_steps": str(accum),
                "train.gradient_checkpointing": str(ckpt), "train.bf16": str(bf16), "train.fp16": "False",
                "train.backend": backend, "model.dropout": "None"},
        tags={"equivalence_key": key, "device": device, "model.dropout_max": str(dropout),
              "model.batchnorm_layers": str(batchnorm), "stage": "train"},
        metrics={"train_mem_peak_bytes": mem, "train_samples_per_second": sps,
                 **(evals or {"eval_loss": 0.5, "eval_accuracy": 0.9})},
        series={"loss": loss, "grad_norm": [(s, 2.0 / s) for s, _ in loss],
                "step_time_s": [(s, 64 / sps) for s, _ in loss],
                "mem_peak_bytes": [(s, mem) for s, _ in loss]},
        start_time=start, status="FINISHED")


def drifted(at: int, rel: float = 1e-2) -> list[tuple[int, float]]:
    """The reference loss, off by ``rel`` (relative) from step ``at`` on, and by 1e-7 before."""
    return [(s, _loss(s) * (1 + (rel if s >= at else 1e-7))) for s in range(1, STEPS + 1)]


def test_identical_series_are_equivalent():
    ref = record("ref", 64, 1)
    other = record("split", 4, 16, start=1)
    c = eq.compare_run(other, ref)
    assert c.status == eq.EQUIVALENT and c.verdict == "equivalent"
    assert c.loss.max_abs == 0 and c.loss.max_rel == 0 and c.loss.common_steps == STEPS
    assert c.first_divergent_step is None and not c.step_mismatch
    assert c.causes == []  # fp32 on CPU, no dropout, same backend


def test_rounding_noise_is_equivalent_in_fp32():
    ref = record("ref", 64, 1)
    other = record("split", 4, 16, loss=[(s, _loss(s) * (1 + 3e-6)) for s in range(1, STEPS + 1)])
    c = eq.compare_run(other, ref)
    assert c.verdict == "equivalent"
    assert 0 < c.loss.max_rel < 1e-5


def test_drift_past_tolerance_at_step_3_diverges_at_step_3():
    ref = record("ref", 64, 1)
    other = record("split", 4, 16, loss=drifted(3))
    c = eq.compare_run(other, ref)
    assert c.status == eq.DIVERGED
    assert c.verdict == "diverged at step 3"
    assert c.first_divergent_step == 3
    assert c.loss.max_rel == pytest.approx(1e-2, rel=1e-6)
    assert c.loss.max_abs == pytest.approx(max(abs(v - _loss(s)) for s, v in drifted(3)))


def test_dropout_cause_only_when_the_split_differs():
    ref = record("ref", 64, 1, dropout=0.1)
    split = eq.compare_run(record("split", 4, 16, dropout=0.1, loss=drifted(1)), ref)
    assert any(c.startswith("dropout") and "different dropout masks" in c for c in split.causes)
    # Same micro-batch, checkpointing on: the same masks (checkpointing restores the RNG state).
    ckpt = eq.compare_run(record("ckpt", 64, 1, ckpt=True, dropout=0.1), ref)
    assert not any("dropout" in c for c in ckpt.causes)
    # No dropout at all: no dropout cause, whatever the split.
    plain = eq.compare_run(record("split0", 4, 16), record("ref0", 64, 1))
    assert not any("dropout" in c for c in plain.causes)


def test_batchnorm_cause_with_a_different_micro_batch():
    ref = record("ref", 64, 1, batchnorm=3)
    c = eq.compare_run(record("split", 8, 8, batchnorm=3, loss=drifted(1)), ref)
    assert c.verdict == "diverged at step 1"
    assert any("BatchNorm" in x and "per micro-batch" in x for x in c.causes)
    same = eq.compare_run(record("ckpt", 64, 1, ckpt=True, batchnorm=3), ref)
    assert not any("BatchNorm" in x for x in same.causes)


def test_other_causes_mixed_precision_gpu_backend():
    ref = record("ref", 64, 1, bf16=True, device="NVIDIA H200")
    c = eq.compare_run(record("acc", 4, 16, bf16=True, device="NVIDIA H200", backend="accelerate"), ref)
    text = " | ".join(c.causes)
    assert "mixed precision (bf16)" in text
    assert "non-deterministic GPU kernels (NVIDIA H200)" in text
    assert "a different backend (accelerate vs trainer)" in text


def test_bf16_uses_the_looser_tolerance():
    assert eq.TOLERANCES["bf16"].rtol == pytest.approx(1e-2)
    assert eq.TOLERANCES["fp32"].rtol == pytest.approx(1e-4)
    loss = drifted(3, rel=3e-3)  # beyond fp32's tolerance, within bf16's
    fp32 = eq.compare_run(record("a", 4, 16, loss=loss), record("ref", 64, 1))
    assert fp32.precision == "fp32" and fp32.verdict == "diverged at step 3"
    bf16 = eq.compare_run(record("b", 4, 16, bf16=True, loss=loss), record("ref", 64, 1, bf16=True))
    assert bf16.precision == "bf16" and bf16.tolerance == eq.TOLERANCES["bf16"]
    assert bf16.verdict == "equivalent"
    assert eq.compare_run(record("c", 4, 16, bf16=True, loss=drifted(5, rel=5e-2)),
                          record("ref", 64, 1, bf16=True)).verdict == "diverged at step 5"


def test_reference_is_largest_micro_batch_then_no_checkpointing_then_earliest():
    runs = [record("small", 4, 16, start=1), record("big-ckpt", 64, 1, ckpt=True, start=2),
            record("big-late", 64, 1, start=5), record("big-early", 64, 1, start=3)]
    assert eq.choose_reference(runs).name == "big-early"
    assert eq.choose_reference(runs[:3]).name == "big-late"
    assert eq.choose_reference(runs[:2]).name == "big-ckpt"
    # a run without any per-step loss is not chosen while another has one
    empty = record("empty", 128, 1)
    empty.series = {}
    assert eq.choose_reference([empty, runs[0]]).name == "small"


def test_step_mismatch_and_missing_series():
    ref = record("ref", 64, 1)
    short = eq.compare_run(record("short", 4, 16, loss=[(s, _loss(s)) for s in range(1, 5)]), ref)
    assert short.status == eq.INCOMPLETE and short.step_mismatch
    assert "4 vs 8 steps" in short.verdict
    nothing = record("nothing", 4, 16)
    nothing.series = {}
    assert eq.compare_run(nothing, ref).status == eq.NO_DATA


def test_nan_on_one_side_diverges():
    loss = [(s, float("nan") if s == 4 else _loss(s)) for s in range(1, STEPS + 1)]
    assert eq.compare_run(record("nan", 4, 16, loss=loss), record("ref", 64, 1)).verdict == "diverged at step 4"


def test_compare_groups_by_key_with_trade_offs_and_summary():
    runs = [record("ref", 64, 1, start=1, mem=4e9, sps=100, evals={"eval_loss": 0.5, "eval_accuracy": 0.90}),
            record("split", 4, 16, start=2, mem=1e9, sps=60, evals={"eval_loss": 0.5, "eval_accuracy": 0.90}),
            record("ckpt", 64, 1, ckpt=True, start=3, mem=2e9, sps=80,
                   evals={"eval_loss": 0.51, "eval_accuracy": 0.92}),
            record("drop", 8, 8, dropout=0.1, loss=drifted(3), start=4),
            record("alone", 16, 1, key="fedcba9876543210", start=0)]
    nokey = record("old", 8, 1)
    nokey.tags.pop("equivalence_key")
    result = eq.compare(runs + [nokey])
    assert [r.name for r in result.skipped] == ["old"]
    assert [g.key for g in result.groups] == [KEY, "fedcba9876543210"]  # groups that compare first
    g = result.groups[0]
    assert g.reference.name == "ref" and g.rows[0].is_reference
    by = {c.run.name: c for c in g.rows}
    assert by["split"].memory_ratio == pytest.approx(0.25)
    assert by["split"].throughput_ratio == pytest.approx(0.6)
    assert by["ckpt"].eval_deltas["eval_accuracy"] == pytest.approx(0.02)
    assert by["ckpt"].eval_deltas["eval_loss"] == pytest.approx(0.01)
    assert by["split"].run.mean_step_time_s == pytest.approx(64 / 60)
    assert by["drop"].verdict == "diverged at step 3"
    assert g.count(eq.EQUIVALENT) == 2 and g.count(eq.DIVERGED) == 1
    assert "2 of 3 equivalent" in g.summary and "first at step 3" in g.summary and "dropout" in g.summary
    assert "least memory: 4x16" in g.summary
    assert "Nothing to compare" in result.groups[1].summary
