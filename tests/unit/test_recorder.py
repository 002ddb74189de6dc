"""StepRecorder: per-step rows, the NaN/inf stop, and the summary."""
from __future__ import annotations

import math

import pytest
import torch

from onegpu.training.callbacks import BatchCounter, StepRecorder, TrainingDiverged


def _recorder():
    sunk = []
    rec = StepRecorder(lambda m, s: sunk.append((s, m)), "cpu", BatchCounter())
    rec.start()
    return rec, sunk


def _step(rec, step, loss, rows=4, tokens=10):
    rec.counter.add({"input_ids": torch.zeros(rows, 5), "attention_mask": torch.ones(rows, tokens // rows + 0)})
    rec.end_step(step)
    rec.log(step, loss, 1.0, 1e-3)


def test_rows_summary_and_sink():
    rec, sunk = _recorder()
    for s, loss in ((1, 2.0), (2, 1.0)):
        _step(rec, s, loss)
    assert [s for s, _ in sunk] == [1, 2]
    assert set(sunk[0][1]) == {"loss", "grad_norm", "learning_rate", "step_time_s", "samples_per_second",
                               "tokens_per_second", "mem_peak_bytes"}
    summ = rec.summary()
    assert summ["train_loss"] == 1.5 and summ["train_steps"] == 2 and summ["train_samples"] == 8
    assert summ["train_runtime"] > 0 and summ["train_mem_peak_bytes"] > 0


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_non_finite_loss_stops_training_naming_the_step(bad):
    rec, sunk = _recorder()
    _step(rec, 1, 2.0)
    with pytest.raises(TrainingDiverged, match="at optimizer step 2") as e:
        _step(rec, 2, bad)
    assert e.value.step == 2
    assert "learning rate" in str(e.value) and "fp16" in str(e.value)
    assert [s for s, _ in sunk] == [1, 2]  # the bad step is still logged: nothing measured is lost
