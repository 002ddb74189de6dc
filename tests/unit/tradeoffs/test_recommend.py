"""The recommendation: the faster same-training knobs combined within the budget (onegpu.tradeoffs.recommend)."""
from __future__ import annotations

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
            "adafactor": _run("adafactor", key="k3", step_time=0.5)}
    variants = [BASE,
                _variant("split-16x1", "split", overrides=(("train.per_device_train_batch_size", "16"),
                                                           ("train.gradient_accumulation_steps", "1"))),
                _variant("checkpointing", "checkpointing", overrides=(("train.gradient_checkpointing", "true"),)),
                _variant("bf16", "precision", knobs.PRECISION, (("train.bf16", "true"),)),
                _variant("adafactor", "optimizer", knobs.DIFFERENT, (("train.optim", "adafactor"),)),
                _variant("attn-eager", "attention", overrides=(("model.attn_implementation", "eager"),)),
                _variant("compile", "compile", overrides=(("train.torch_compile", "true"),)),
                _variant("lora", "lora", knobs.DIFFERENT)]  # not run
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
