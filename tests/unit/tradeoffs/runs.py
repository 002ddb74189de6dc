"""Synthetic training runs and variants for the tradeoffs tests. Not a test module."""
from __future__ import annotations

from onegpu.compare import RunRecord
from onegpu.tradeoffs import knobs, measurement

STEPS = 6


def _run(name, key="k1", step_time=1.0, first=5.0, loss_scale=1.0, examples=16, mem=(100, 100, 200, 50),
         test_loss=1.0, params=None, device="cpu", peak=None):
    series = {"loss": [(s, (2.0 - 0.1 * s) * loss_scale) for s in range(1, STEPS + 1)],
              "grad_norm": [(s, 1.0 * loss_scale) for s in range(1, STEPS + 1)],
              "step_time_s": [(s, first if s == 1 else step_time) for s in range(1, STEPS + 1)],
              "step_examples": [(s, float(examples)) for s in range(1, STEPS + 1)]}
    metrics = {"train_runtime": first + step_time * (STEPS - 1), "test_loss": test_loss,
               "train_samples_per_second": examples * STEPS / (first + step_time * (STEPS - 1))}
    metrics.update(dict(zip(measurement.BREAKDOWN, [m * 2**20 for m in mem])))
    if peak is not None:
        metrics["train_mem_peak_bytes"] = peak
    return RunRecord(run_id=name, name=name, params={"train.per_device_train_batch_size": "8",
                                                     "train.gradient_accumulation_steps": "2",
                                                     **(params or {})},
                     tags={"equivalence_key": key, "device": device}, metrics=metrics, series=series,
                     status="FINISHED")


def _variant(name, knob, expect=knobs.SAME, overrides=(("train.x", "1"),)):
    return knobs.Variant(name, knob, overrides, expect, name)


BASE = knobs.Variant("baseline", "baseline", (), knobs.SAME, "your params")
