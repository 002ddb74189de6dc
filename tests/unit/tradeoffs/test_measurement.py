"""Each variant's run against the baseline (onegpu.tradeoffs.measurement): steady samples/s, memory, verdicts."""
from __future__ import annotations

import pytest

from onegpu.tradeoffs import knobs, measurement, recommend, report as tradeoffs_report
from tests.unit.tradeoffs.runs import BASE, STEPS, _run, _variant


def test_speed_excludes_step_one_and_memory_is_the_breakdown_on_cpu():
    base = _run("baseline")
    fast = _run("split", step_time=0.5, first=30.0, mem=(100, 100, 200, 100))  # slow first step (compile)
    row = measurement.measure_row(_variant("split", "split"), fast, base)
    assert row.samples_per_second == pytest.approx(32.0)  # 16 examples / 0.5 s, steps 2..6
    assert row.speedup == pytest.approx(2.0)
    assert row.first_step_s == 30.0
    assert row.memory_bytes == 500 * 2**20 and row.memory_kind == "breakdown"
    assert row.memory_ratio == pytest.approx(500 / 450)
    assert row.verdict == measurement.SAME_TRAINING and row.same_training
    assert row.time_to_test_loss_s == row.train_runtime_s  # same eval loss: reached
    assert row.notes == []
    stalled = _run("split", step_time=0.5, first=30.0)
    stalled.series["step_time_s"][-1] = (STEPS, 20.0)  # a one-off stall, nothing compiled: counted
    row = measurement.measure_row(_variant("split", "split"), stalled, base)
    assert row.notes == [f"optimizer step {STEPS} took 20.0 s against a median 0.50 s without compiling (a one-off "
                         "stall); its samples/s count them"]
    assert row.samples_per_second == pytest.approx(16 * 5 / (0.5 * 4 + 20.0))


def test_a_rows_warm_up_is_in_none_of_its_windows():
    """Issue 64: a step that compiled (``step_compile_s`` > 0: torch.compile's graphs after step 1, a
    recompilation for a new shape, torchao's optimizer step) is warm-up, left out of the row's samples/s as
    step 1 is, in every window (each repeat against the baseline of its round); its seconds are the row's
    ``compile_s``, summed over the windows, and the batch's notes say them apart from the wall time."""
    from onegpu.tradeoffs import batch
    base = _run("baseline")
    windows = []
    for _ in (1, 2):
        run = _run("compile", step_time=0.5, first=30.0)
        run.series["step_time_s"][1] = (2, 12.0)  # step 2 recompiles (a new shape): 11.5 s of compiling
        run.series["step_time_s"][3] = (4, 3.0)   # step 4 compiles the optimizer step's graph
        run.series["step_compile_s"] = [(1, 29.0), (2, 11.5), (3, 0.0), (4, 2.5), (5, 0.0), (6, 0.0)]
        windows.append(measurement.measure_row(_variant("compile", "compile"), run, base))
    for row in windows:
        assert row.samples_per_second == pytest.approx(32.0)  # steps 3, 5 and 6 alone: 16 examples / 0.5 s
        assert row.speedup == pytest.approx(2.0)
        assert row.compile_s == pytest.approx(43.0)
        assert row.notes == ["optimizer step 2 compiled (11.5 s of its 12.0 s), 4 compiled (2.5 s of its 3.0 s): "
                             "warm-up, left out of its samples/s"]
    both = measurement.aggregate(_variant("compile", "compile"), windows)
    assert both.speedup == pytest.approx(2.0) and both.speedup_range == pytest.approx((2.0, 2.0))
    assert both.compile_s == pytest.approx(86.0)
    runs = {"baseline": base, "compile": windows[0].run, "compile-r2": windows[1].run}
    plan = {"runner": batch.WORKERS, "wall_s": {"baseline": 10.0, "compile": 50.0, "compile-r2": 50.0}}
    assert batch.timing(plan, runs)[0].startswith(
        "the rows took 110 s of wall time (3 rows in worker processes, one at a time), 86 s of it compiling "
        "(warm-up: torch.compile, torchao's optimizer step; in no window's samples/s) in 2 of them")


def test_memory_on_gpu_is_the_allocator_peak():
    run = _run("b", device="NVIDIA H200", peak=3e9)
    assert measurement.memory_bytes(run) == (3e9, "allocator peak")


def test_verdicts_precision_different_and_diverged():
    base = _run("baseline")
    bf16 = _run("bf16", key="k2", loss_scale=1.004, params={"train.bf16": "true"})
    row = measurement.measure_row(_variant("bf16", "precision", knobs.PRECISION), bf16, base)
    assert row.verdict == "same within bf16 tolerance" and not row.same_training
    far = _run("bf16", key="k2", loss_scale=1.5, params={"train.bf16": "true"})
    row = measurement.measure_row(_variant("bf16", "precision", knobs.PRECISION), far, base)
    assert row.verdict == "differs beyond bf16 tolerance at step 1"
    ada = _run("adafactor", key="k3", loss_scale=1.0, test_loss=1.2)
    row = measurement.measure_row(_variant("adafactor", "optimizer", knobs.DIFFERENT), ada, base)
    assert row.verdict == measurement.DIFFERENT_TRAINING  # another key, even with equal losses
    assert row.time_to_test_loss_s is None  # 1.2 > 1.0: not reached
    assert tradeoffs_report._time_to_loss(row) == "not reached"
    better = _run("lora", key="k4", test_loss=0.9)
    assert measurement.measure_row(_variant("lora", "lora", knobs.DIFFERENT), better, base).time_to_test_loss_s \
        == better.metrics["train_runtime"]
    eager = _run("attn-eager", loss_scale=1.01, params={"model.attn_implementation": "eager"})
    row = measurement.measure_row(_variant("attn-eager", "attention"), eager, base)
    assert row.verdict.startswith("diverged at step 1: model.attn_implementation differs")
    assert not row.same_training


def test_dropout_masks_alone_make_a_row_same_in_expectation_and_a_candidate():
    """With dropout, another split (or attention kernel, or torch.compile) draws other masks: the losses
    differ at step 1, yet the training is the same in distribution; such a row is labelled and may be
    recommended. Without dropout the same difference is a divergence."""
    drop = {"model.dropout_max": "0.1"}
    base = _run("baseline")
    base.tags.update(drop)
    split = _run("split-16x1", step_time=0.5, loss_scale=1.01,
                 params={"train.per_device_train_batch_size": "16", "train.gradient_accumulation_steps": "1"})
    split.tags.update(drop)
    v = _variant("split-16x1", "split",
                 overrides=(("model.dropout", "0.1"), ("train.per_device_train_batch_size", "16")))
    row = measurement.measure_row(v, split, base)
    assert row.verdict == measurement.IN_EXPECTATION and row.same_training
    attn = _run("attn-eager", step_time=0.8, loss_scale=1.01, params={"model.attn_implementation": "eager"})
    attn.tags.update(drop)
    va = _variant("attn-eager", "attention",
                  overrides=(("model.dropout", "0.1"), ("model.attn_implementation", "eager")))
    arow = measurement.measure_row(va, attn, base)
    assert arow.verdict == measurement.IN_EXPECTATION
    rec = recommend.recommend([measurement.measure_row(BASE, base, base), row, arow], None)
    # the shared -S (model.dropout) once, then each knob's own
    assert rec.variant.overrides == (("model.dropout", "0.1"), ("train.per_device_train_batch_size", "16"),
                                     ("model.attn_implementation", "eager"))
    nodrop = _run("split-16x1", step_time=0.5, loss_scale=1.01,
                  params={"train.per_device_train_batch_size": "16", "train.gradient_accumulation_steps": "1"})
    row = measurement.measure_row(v, nodrop, _run("baseline"))
    assert row.verdict.startswith("diverged at step 1") and not row.same_training


def test_a_row_with_some_repeats_measured_says_how_many_never_just_not_run():
    """Issue 30: Ctrl-C after the baseline's first repeat (of 3) trained its 6 steps: the table said "not run"."""
    split = _variant("split-16x1", "split")
    runs = {"baseline": _run("baseline"), "split-16x1": _run("split-16x1"), "baseline-r2": _run("baseline-r2")}
    runs["baseline-r2"].status = "KILLED"  # stopped during its training
    rows = measurement.measure_rows([BASE, split], runs, repeats=3)
    assert [r.verdict for r in rows] == ["1 of 3 repeats measured, then stopped",
                                         "1 of 3 repeats measured, then not run"]
    assert all(r.run is None for r in rows)  # still no measurement: nothing is recommended from it
    assert recommend.completeness(rows) == (0, 2)
    text = tradeoffs_report.terminal(rows, recommend.recommend(rows, None), None)
    assert "not run |" not in text.replace("then not run", "")
    assert "1 of 3 repeats measured, then stopped" in text
