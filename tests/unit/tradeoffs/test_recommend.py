"""The recommendation: the faster same-training knobs combined within the budget (onegpu.tradeoffs.recommend)."""
from __future__ import annotations

import pytest

from onegpu.tradeoffs import knobs, measurement, recommend
from tests.unit.tradeoffs.runs import BASE, _run, _variant


def test_recommend_combines_the_faster_same_training_knobs():
    base = _run("baseline")
    runs = {"baseline": base,
            "split-16x1": _run("split-16x1", step_time=0.7, mem=(100, 100, 200, 100)),  # 1.43x
            "attn-eager": _run("attn-eager", step_time=0.9),                            # 1.11x
            "compile": _run("compile", step_time=0.98),                                 # 1.02x: noise
            "checkpointing": _run("checkpointing", step_time=1.3, mem=(100, 100, 200, 5)),
            "bf16": _run("bf16", key="k2", step_time=0.5, params={"train.bf16": "true"}),
            "adafactor": _run("adafactor", key="k3", step_time=0.5), "lora": _run("lora", key="k4")}
    variants = [BASE,
                _variant("split-16x1", "split", overrides=(("train.per_device_train_batch_size", "16"),
                                                           ("train.gradient_accumulation_steps", "1"))),
                _variant("checkpointing", "checkpointing", overrides=(("train.gradient_checkpointing", "true"),)),
                _variant("bf16", "precision", knobs.PRECISION, (("train.bf16", "true"),)),
                _variant("adafactor", "optimizer", knobs.DIFFERENT, (("train.optim", "adafactor"),)),
                _variant("attn-eager", "attention", overrides=(("model.attn_implementation", "eager"),)),
                _variant("compile", "compile", overrides=(("train.torch_compile", "true"),)),
                _variant("lora", "lora", knobs.DIFFERENT)]
    rows = measurement.measure_rows(variants, runs)
    rec = recommend.recommend(rows, budget_bytes=None)
    assert rec.variant.name == "recommended"
    assert rec.variant.overrides == (("train.per_device_train_batch_size", "16"),
                                     ("train.gradient_accumulation_steps", "1"),
                                     ("model.attn_implementation", "eager"))
    assert [r.variant.name for r in rec.parts] == ["split-16x1", "attn-eager"]
    left = dict(rec.left_out)
    assert left["compile"] == "2% faster: within run-to-run noise"
    assert left["checkpointing"] == "not faster"
    assert left["bf16"] == "same within bf16 tolerance"
    assert "adafactor" not in left and "lora" not in left  # different trainings are not candidates
    # A budget below the split's memory (500 MiB) leaves the split out: one knob stands for itself.
    rec = recommend.recommend(rows, budget_bytes=480 * 2**20)
    assert rec.variant.name == "attn-eager" and dict(rec.left_out)["split-16x1"] == "over the memory budget"
    rec = recommend.recommend(rows[:1] + rows[2:3], budget_bytes=None)  # baseline + checkpointing only
    assert rec.variant is None


def _under_load(run, share=0.7):
    import json
    run.tags["onegpu.outside_load"] = json.dumps({"cpu_busy": 2 * share, "cpus": 2, "share": share,
                                                  "loadavg": [12.0, 12.0]})
    return run


def test_a_speed_measured_under_outside_load_is_not_taken_as_a_gain():
    """Issue 20 item 3: a tradeoffs baseline that trained while another job loaded the machine made
    16x1 look 15.97x faster. A row (or a baseline) under outside load is named with the figure and left out."""
    from onegpu.tradeoffs import report
    split = _variant("split-16x1", "split", overrides=(("train.per_device_train_batch_size", "16"),))
    rows = measurement.measure_rows([BASE, split], {"baseline": _under_load(_run("baseline", step_time=9.0)),
                                                    "split-16x1": _run("split-16x1", step_time=0.5)})
    rec = recommend.recommend(rows, budget_bytes=None)
    assert rec.variant is None
    assert dict(rec.left_out)["split-16x1"] == ("the baseline's speed measured under outside load: other "
                                                "processes used 1.40 of 2 CPUs (70%), load average 12.0 -> 12.0")
    md = report.markdown(rows, rec, None, "t", image=None)
    assert "- baseline: speed measured under outside load: other processes used 1.40 of 2 CPUs" in md
    rows = measurement.measure_rows([BASE, split], {"baseline": _run("baseline"),
                                                    "split-16x1": _under_load(_run("split-16x1", step_time=0.5))})
    assert dict(recommend.recommend(rows, None).left_out)["split-16x1"].startswith(
        "speed measured under outside load: other processes used 1.40")
    quiet = measurement.measure_rows([BASE, split], {"baseline": _under_load(_run("baseline"), share=0.02),
                                                     "split-16x1": _run("split-16x1", step_time=0.5)})
    assert recommend.recommend(quiet, None).variant.name == "split-16x1"  # 2% of the CPUs: no load


def _repeats(name, step_times, **kw):
    """``{name, name-r2, ...}``: one run per repeat, each with its own step time (s)."""
    return {measurement.repeat_name(name, r): _run(name, step_time=t, **kw) for r, t in enumerate(step_times, 1)}


def test_with_repeats_a_no_op_knob_is_no_clear_difference_and_a_clear_gain_is_recommended():
    """An injected no-op knob (the same training, the same speed: its runs differ from the baseline's
    only by the machine's noise) whose median happens to be 6% faster is not recommended: its slowest
    repeat is inside the baseline's spread. A knob ~1.4x faster in every round is."""
    runs = {**_repeats("baseline", [1.0, 1.08, 0.95]),
            **_repeats("noop", [0.92, 1.00, 0.93]),        # 1.09x, 1.08x, 1.02x of each round's baseline
            **_repeats("split-16x1", [0.70, 0.78, 0.66])}  # 1.43x, 1.38x, 1.44x
    variants = [BASE, _variant("noop", "compile"), _variant("split-16x1", "split")]
    rows = measurement.measure_rows(variants, runs, repeats=3)
    base, noop, split = rows
    assert base.repeats == 3 and base.speedup_range == pytest.approx((1.0 / 1.08 * 1.0, 1.0 / 0.95))
    assert noop.speedup == pytest.approx(1.08) and noop.speedup_range == pytest.approx((0.95 / 0.93, 1 / 0.92))
    rec = recommend.recommend(rows, budget_bytes=None)
    assert rec.variant is split.variant
    why = dict(rec.left_out)["noop"]
    assert why == "no clear difference (1.08x, 1.02x-1.09x over 3 repeats; the baseline's own spread +5%)", why
    # one run each: the old rule (at least 5% faster) is all there is; a 6% no-op then passes
    once = measurement.measure_rows(variants, {"baseline": runs["baseline"], "noop": _run("noop", step_time=0.94),
                                               "split-16x1": runs["split-16x1"]})
    assert [r.variant.name for r in recommend.recommend(once, None).parts] == ["split-16x1", "noop"]


def test_a_batch_with_a_row_missing_or_stopped_recommends_nothing():
    """Rows stopped (`dvc queue stop --kill`: the run KILLED; Ctrl-C before the run opened) or not run:
    'incomplete', no recommendation, even when a measured knob was clearly faster."""
    killed = _run("attn-eager", step_time=0.5)
    killed.status = "KILLED"
    runs = {"baseline": _run("baseline"), "split-16x1": _run("split-16x1", step_time=0.5), "attn-eager": killed}
    variants = [BASE, _variant("split-16x1", "split"), _variant("attn-eager", "attention"),
                _variant("compile", "compile"), _variant("checkpointing", "checkpointing")]
    rows = measurement.measure_rows(variants, runs, states={"checkpointing": "Stopped"})
    assert [r.verdict for r in rows[2:]] == ["stopped", "not run", "stopped"]
    assert measurement.unmeasured(_run("x"), "Stopped") is None  # its training ended before the stop: measured
    rec = recommend.recommend(rows, budget_bytes=None)
    assert rec.incomplete == (2, 5) and rec.variant is None and rec.parts == []
    # a failed row is a measured outcome: the batch is complete without it
    failed = _run("attn-eager")
    failed.status = "FAILED"
    rows = measurement.measure_rows(variants[:3], {**runs, "attn-eager": failed})
    rec = recommend.recommend(rows, budget_bytes=None)
    assert rec.incomplete is None and rec.variant.name == "split-16x1"
    assert dict(rec.left_out) == {"attn-eager": "failed"}
