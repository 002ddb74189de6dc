"""Equivalence logic on synthetic run records: verdicts, tolerances, causes, reference choice."""
from __future__ import annotations

import math

import pytest

from onegpu import compare as eq
from onegpu.compare import RunRecord
from tests.tables import row

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
    # Another attention kernel or torch.compile draws other masks too (same split).
    for knob, value in (("model.attn_implementation", "eager"), ("train.torch_compile", "True")):
        other = record("kernel", 64, 1, dropout=0.1, loss=drifted(1))
        other.params[knob] = value
        c = eq.compare_run(other, ref)
        assert any(x.startswith("dropout") and f"({knob} differs)" in x for x in c.causes), c.causes
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


# -- issue 9: grad_norm in the verdict, stated tolerances, overlapping runs, partial steps -----------

def test_grad_norm_beyond_its_tolerance_diverges_even_when_the_loss_agrees():
    ref = record("ref", 64, 1)
    other = record("split", 4, 16)
    other.series["grad_norm"] = [(s, (2.0 / s) * (1 + (1e-2 if s >= 4 else 1e-7))) for s in range(1, STEPS + 1)]
    c = eq.compare_run(other, ref)
    assert c.loss.max_abs == 0
    assert c.status == eq.DIVERGED and c.verdict == "diverged at step 4 (grad_norm)"
    assert c.first_divergent_metric == "grad_norm" and c.grad_norm.max_rel == pytest.approx(1e-2, rel=1e-6)
    # Rounding-size differences in the norm (well within fp32's 1e-3) stay equivalent.
    other.series["grad_norm"] = [(s, (2.0 / s) * (1 + 5e-5)) for s in range(1, STEPS + 1)]
    assert eq.compare_run(other, ref).verdict == "equivalent"


def test_tolerances_are_stated_with_eps_and_basis():
    assert eq.EPS["fp32"] == pytest.approx(1.19e-7, rel=1e-2) and eq.EPS["bf16"] == pytest.approx(7.8e-3, rel=1e-2)
    assert eq.GRAD_NORM_TOLERANCES["fp32"].rtol == pytest.approx(1e-3)
    assert set(eq.TOLERANCE_BASIS) == set(eq.TOLERANCES) == set(eq.GRAD_NORM_TOLERANCES)
    from onegpu.compare import report
    md = report.markdown(eq.compare([record("ref", 64, 1), record("split", 4, 16, start=1)]), images=())
    assert row(md, "fp32")[:4] == ["fp32", "1.19e-07", "0.0001 / 1e-06", "0.001 / 1e-06"]
    assert "measured here" in md and "grad_norm" in md
    assert "max rel Δ grad_norm" in md


def windowed(name, micro, accum, start_s, end_s, machine="m1", **kw) -> RunRecord:
    r = record(name, micro, accum, **kw)
    r.tags.update({"onegpu.train_start_ms": str(start_s * 1000), "onegpu.train_end_ms": str(end_s * 1000),
                   "onegpu.machine": machine})
    return r


def test_runs_that_trained_at_the_same_time_have_no_comparable_speed():
    """Issue 9 case 6: with `dvc queue start -j 2` 4x4 ckpt looked faster than 4x4 without (0.42x vs
    0.31x of the reference): the two shared the cores. Their speed and memory are marked, not ranked."""
    ref = windowed("ref", 16, 1, 0, 100, sps=100.0)
    a = windowed("a-ckpt", 4, 4, 200, 400, ckpt=True, sps=42.0, mem=5e8)
    b = windowed("b", 4, 4, 250, 420, sps=31.0, mem=6e8)
    late = windowed("late", 8, 2, 500, 600, sps=120.0)
    elsewhere = windowed("elsewhere", 2, 8, 200, 400, machine="m2", sps=20.0)
    cmp = eq.compare([ref, a, b, late, elsewhere])
    rows = {c.run.name: c for c in cmp.groups[0].rows}
    assert rows["a-ckpt"].overlaps == ["b"] and rows["b"].overlaps == ["a-ckpt"]
    assert rows["ref"].cost_comparable and rows["late"].cost_comparable and rows["elsewhere"].cost_comparable
    summary = cmp.groups[0].summary
    assert "Speed and memory not comparable for b, a-ckpt" in summary
    assert "the fastest: 8x2" in summary  # 120 samples/s
    assert "4x4" not in summary.split("Among")[1]  # a-ckpt's 477 MiB is not ranked "least memory"
    from onegpu.compare import report
    md = report.markdown(cmp, images=())
    assert {"42.0*", "0.42x*", "477*"} <= set(row(md, "a-ckpt"))
    assert "a-ckpt trained at the same time as b" in md and "dvc queue start -j 1" in md
    assert not any("*" in cell for cell in row(md, "late"))
    term = report.terminal_table(cmp)
    assert "42.0*" in term and "not comparable" in term and "120.0*" not in term


def test_an_overlap_with_a_run_outside_the_selection_counts():
    ref = windowed("ref", 16, 1, 0, 100)
    other_key = windowed("sweep", 16, 1, 50, 150, key="ffffffffffffffff")
    cmp = eq.compare([ref], others=[other_key])
    assert cmp.groups[0].rows[0].overlaps == ["sweep"]
    # A touch of less than a second is not an overlap (a queue's next run starting as one ends).
    assert eq.find_overlaps([windowed("x", 1, 1, 0, 10)], [windowed("y", 1, 1, 9.5, 20)]) == {}


def test_a_short_last_step_is_noted():
    import json
    ref = record("ref", 16, 1)
    ref.tags["onegpu.partial_steps"] = json.dumps([{"step": 7, "examples": 4, "effective_batch": 16}])
    other = record("split", 4, 4)
    other.series["step_examples"] = [(s, 4 if s == 7 else 16) for s in range(1, STEPS + 1)]
    cmp = eq.compare([ref, other])
    rows = cmp.groups[0].rows
    assert all(any("optimizer step 7 saw 4 of 16 examples" in n for n in c.notes) for c in rows)
    assert "Step 7 saw fewer examples than the effective batch" in cmp.groups[0].summary


def _with(r: RunRecord, **params) -> RunRecord:
    r.params.update({k: str(v) for k, v in params.items()})
    return r


@pytest.mark.parametrize("param,value,named", [
    ("train.tf32", True, "train.tf32 differs (true vs false)"),
    ("model.attn_implementation", "eager", "model.attn_implementation differs (eager vs none)"),
    ("train.torch_compile", True, "train.torch_compile differs (true vs false)"),
    ("train.optim", "adamw_torch_fused", "train.optim differs (adamw_torch_fused vs adamw_torch)"),
    ("train.torch_empty_cache_steps", 4, "train.torch_empty_cache_steps differs (4 vs none)"),
])
def test_compare_names_the_knob_that_differs_when_runs_diverge(param, value, named):
    ref = _with(record("ref", 64, 1), **{"train.optim": "adamw_torch", "train.tf32": False,
                                         "model.attn_implementation": None, "train.torch_compile": False,
                                         "train.torch_empty_cache_steps": None})
    run = _with(record("k", 64, 1, loss=drifted(3)), **{param: value})
    c = eq.compare_run(run, ref)
    assert c.verdict == "diverged at step 3"
    assert any(cause.startswith(named) for cause in c.causes), c.causes
    # the same knob on both sides (or a run logged before the knob existed, read as the default) is no cause
    same = eq.compare_run(_with(record("s", 64, 1, loss=drifted(3)), **{"train.optim": "adamw_torch"}), ref)
    assert not any(param in cause for cause in same.causes), same.causes


def test_tf32_on_a_gpu_uses_its_looser_tolerance_and_is_a_no_op_on_cpu():
    assert eq.EPS["tf32"] == pytest.approx(9.8e-4, rel=1e-2)
    assert eq.TOLERANCES["fp32"].rtol < eq.TOLERANCES["tf32"].rtol < eq.TOLERANCES["bf16"].rtol
    loss = drifted(3, rel=1e-3)  # beyond fp32's tolerance, within tf32's
    gpu = "NVIDIA H200"
    c = eq.compare_run(_with(record("t", 4, 16, loss=loss, device=gpu), **{"train.tf32": True}),
                       record("ref", 64, 1, device=gpu))
    assert c.precision == "tf32" and c.tolerance == eq.TOLERANCES["tf32"] and c.verdict == "equivalent"
    assert any(cause.startswith("train.tf32 differs") for cause in c.causes)
    assert not any("mixed precision" in cause for cause in c.causes)
    cpu = eq.compare_run(_with(record("t", 4, 16, loss=loss), **{"train.tf32": True}), record("ref", 64, 1))
    assert cpu.precision == "fp32" and cpu.verdict == "diverged at step 3"
    assert eq.compare_run(_with(record("t", 4, 16, loss=drifted(4, rel=5e-3), device=gpu), **{"train.tf32": True}),
                          record("ref", 64, 1, device=gpu)).verdict == "diverged at step 4"
