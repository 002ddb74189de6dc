"""The recorder (onegpu.training.record.recorder): per-step rows, the NaN/inf stop, the summary, steady-state
throughput, and the terminal output of training (the progress lines, not HF's log dicts, and the closing line)."""
from __future__ import annotations

import math

import pytest
import torch

from onegpu.training.record.recorder import BatchCounter, StepRecorder, TrainingDiverged, progress_line


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
                               "tokens_per_second", "mem_peak_bytes", "step_examples", "step_tokens",
                               "step_targets", "step_compile_s"}
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


def test_each_step_logs_its_item_counts_and_a_short_last_step_is_reported():
    """Issue 9 case 8: 100 rows at an effective 16 end with a step of 4 rows; each step logs its
    examples, non-padding tokens and loss targets, and the short step is listed."""
    rec, sunk = _recorder()
    # Causal LM: 2-D labels, -100 at padding; lengths 3 and 5 -> 8 tokens, targets (3-1) + (5-1) = 6.
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    labels = torch.tensor([[5, 6, 7, -100, -100], [5, 6, 7, 8, 9]])
    for s, rows in ((1, 8), (2, 2)):  # 16 then 4 examples per step (two micro-batches each)
        for _ in range(2):
            rec.counter.add({"input_ids": torch.zeros(rows, 5, dtype=torch.long),
                             "attention_mask": mask.repeat(rows // 2, 1), "labels": labels.repeat(rows // 2, 1)})
        rec.end_step(s)
        rec.log(s, 1.0, 1.0, 1e-3)
    first, last = sunk[0][1], sunk[1][1]
    assert (first["step_examples"], first["step_tokens"], first["step_targets"]) == (16, 64, 48)
    assert (last["step_examples"], last["step_tokens"], last["step_targets"]) == (4, 16, 12)
    assert rec.partial_steps(16) == [{"step": 2, "examples": 4, "effective_batch": 16}]
    assert rec.partial_steps(4) == []
    # Attention FLOPs need sum(t^2): 10 examples of length 3 and 10 of length 5 = 10*9 + 10*25.
    assert rec.tokens_sq() == 10 * 9 + 10 * 25
    assert rec.window_start <= rec.window_end


def test_classification_targets_are_examples():
    rec, sunk = _recorder()
    rec.counter.add({"input_ids": torch.zeros(3, 4, dtype=torch.long), "attention_mask": torch.ones(3, 4),
                     "labels": torch.tensor([0, 2, 1])})
    rec.end_step(1)
    rec.log(1, 1.0, 1.0, 1e-3)
    assert (sunk[0][1]["step_examples"], sunk[0][1]["step_tokens"], sunk[0][1]["step_targets"]) == (3, 12, 3)


def test_steady_throughput_leaves_out_step_one_and_every_step_that_compiled():
    from onegpu.training.record.recorder import steady_samples_per_second
    rows = [{"step": 1, "samples": 16, "step_time_s": 9.0}, {"step": 2, "samples": 16, "step_time_s": 1.0},
            {"step": 3, "samples": 8, "step_time_s": 0.5}]
    assert steady_samples_per_second(rows) == 24 / 1.5
    assert steady_samples_per_second(rows[:1]) is None and steady_samples_per_second([]) is None
    compiled = [*rows, {"step": 4, "samples": 16, "step_time_s": 7.0, "step_compile_s": 6.5}]
    assert steady_samples_per_second(compiled) == 24 / 1.5
    assert steady_samples_per_second([rows[0], compiled[-1]]) is None  # no steady step: no steady figure


def test_a_step_that_compiles_logs_its_compile_seconds_and_the_others_zero():
    """step_compile_s: TorchDynamo's own timing of the compilations made during the step (here a function
    compiled by the eager backend during step 2 and called again in step 3); 0 for a step that compiled
    nothing. Compiling between steps (as validation may) counts in neither."""
    rec, sunk = _recorder()
    fn = torch.compile(lambda x: torch.sin(x) * 2 + 1, backend="eager")
    _step(rec, 1, 2.0)
    fn(torch.ones(3))
    _step(rec, 2, 1.9)
    fn(torch.ones(3))
    _step(rec, 3, 1.8)
    rec._between_steps(lambda step: {"eval_loss": float(torch.compile(lambda x: x.cos(), backend="eager")(
        torch.ones(2)).sum())}, 3)
    _step(rec, 4, 1.7)
    compiled = {s: m["step_compile_s"] for s, m in sunk if "step_compile_s" in m}
    assert compiled[1] == compiled[3] == compiled[4] == 0.0
    assert 0.0 < compiled[2] < rec.rows[1]["step_time_s"]


# -- the terminal lines ----------------------------------------------------------------------------

ROWS = [{"step": s, "loss": 2.0 - 0.1 * s, "samples_per_second": 40.0 + s, "step_time_s": 0.5 + 0.1 * s,
         "mem_peak_bytes": 3 * 2**29} for s in (1, 2, 3, 4)]


def test_progress_line_names_step_loss_speed_memory_and_time_left():
    # mean step time after the first (warm-up) row: 0.8 s x 36 steps to go = 28.8 s
    assert progress_line(4, 40, ROWS, "cpu") == (
        "step 4/40 | loss 1.6000 | 44.0 samples/s | 0.90 s/step | peak 1.50 GiB RSS | 29 s left")
    # On a GPU the memory is the allocator's; long waits in minutes (4000 x 0.8 s = 53.3 min)
    assert progress_line(4, 4004, ROWS, "cuda:0").endswith("| peak 1.50 GiB allocated | 53.3 min left")
    # a first step of 20 s (torchao compiling its optimizer step) does not inflate the time left
    slow_first = [{**ROWS[0], "step_time_s": 20.0}, *ROWS[1:]]
    assert progress_line(4, 40, slow_first, "cpu").endswith("| 29 s left")
    assert progress_line(1, 40, slow_first[:1], "cpu").endswith("| 13.0 min left")  # 39 x 20 s: all it knows


def test_first_step_note_only_for_optimizers_that_compile_their_step():
    from transformers.training_args import OptimizerNames

    from onegpu.training.record.recorder import first_step_note
    assert first_step_note("adamw_torch_4bit") == (
        "adamw_torch_4bit: torchao compiles its optimizer step during step 1 (tens of seconds on a CPU); "
        "the time left and the steady-state throughput leave out the steps that compile")
    assert first_step_note(OptimizerNames.ADAMW_TORCH_8BIT).startswith("adamw_torch_8bit: torchao compiles")
    assert first_step_note("adamw_torch") is None and first_step_note(OptimizerNames.ADAMW_BNB) is None


@pytest.mark.parametrize("backend", ["trainer", "accelerate"])
def test_training_prints_onegpu_progress_not_hf_log_dicts(backend, capsys):
    pytest.importorskip("torch")
    import importlib

    from onegpu.config import from_container
    from tests.unit.tiny import dataset, tiny_bert, tokenizer
    cfg = from_container({"model": {"dropout": 0.0},
                          "train": {"backend": backend, "per_device_train_batch_size": 4,
                                    "gradient_accumulation_steps": 2, "max_steps": 3, "logging_steps": 2}},
                         source="test")
    from onegpu.training.backends import base
    module = importlib.import_module(base.REGISTRY[backend])
    module.train(base.TrainRequest(tiny_bert(), tokenizer(), dataset(24), cfg, sink=lambda m, s: None))
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if ln.startswith("step ")]
    # every logging_steps (2) optimizer steps and at the last (3)
    assert [ln.split(" | ")[0] for ln in lines] == ["step 2/3", "step 3/3"], out
    assert all(" samples/s | " in ln and " GiB RSS | " in ln for ln in lines), out
    assert "{'loss'" not in out and "'train_runtime'" not in out, out
    # one start line (onegpu.training.around_steps.Start), the same wording on both backends
    assert (f"train: 3 optimizer steps of 8 examples (4 x 2), 24 training examples in 1 epoch(s); the {backend} "
            "backend on cpu, mixed precision no; progress every 2 steps, every step goes to MLflow"
            in out.splitlines()), out


def test_cpu_peak_says_it_is_process_rss_and_why_it_exceeds_the_auto_budget():
    from onegpu.training.record.recorder import peak_text
    text = peak_text(1727 * 2**20, "cpu", int(0.8 * 2**30))
    assert text.startswith("peak 1,727 MiB process RSS (the auto budget, 0.80 GiB, covers the probed training "
                           "state only; RSS also holds the Python runtime, libraries and data)")
    assert peak_text(1727 * 2**20, "cpu", None) == "peak 1,727 MiB process RSS"
    assert peak_text(1727 * 2**20, "cuda:0", 2**30) == "peak 1,727 MiB allocated"
