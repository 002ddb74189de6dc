"""Terminal output of training: onegpu's own progress lines (not HF's log dicts) and the closing line."""
from __future__ import annotations

import pytest

from onegpu.training.recorder import progress_line

ROWS = [{"step": s, "loss": 2.0 - 0.1 * s, "samples_per_second": 40.0 + s, "step_time_s": 0.5 + 0.1 * s,
         "mem_peak_bytes": 3 * 2**29} for s in (1, 2, 3, 4)]


def test_progress_line_names_step_loss_speed_memory_and_time_left():
    # mean step time 0.75 s x 36 steps to go = 27 s
    assert progress_line(4, 40, ROWS, "cpu") == (
        "step 4/40 | loss 1.6000 | 44.0 samples/s | 0.90 s/step | peak 1.50 GiB RSS | 27 s left")
    # On a GPU the memory is the allocator's; long waits in minutes (4000 x 0.75 s = 50 min)
    assert progress_line(4, 4004, ROWS, "cuda:0").endswith("| peak 1.50 GiB allocated | 50.0 min left")


@pytest.mark.parametrize("backend", ["trainer", "accelerate"])
def test_training_prints_onegpu_progress_not_hf_log_dicts(backend, capsys):
    pytest.importorskip("torch")
    from test_backends import dataset, tiny_bert, tokenizer

    import importlib

    from onegpu.config import from_container
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


def test_cpu_peak_says_it_is_process_rss_and_why_it_exceeds_the_auto_budget():
    from onegpu.training.recorder import peak_text
    text = peak_text(1727 * 2**20, "cpu", int(0.8 * 2**30))
    assert text.startswith("peak 1,727 MiB process RSS (the auto budget, 0.80 GiB, covers the probed training "
                           "state only; RSS also holds the Python runtime, libraries and data)")
    assert peak_text(1727 * 2**20, "cpu", None) == "peak 1,727 MiB process RSS"
    assert peak_text(1727 * 2**20, "cuda:0", 2**30) == "peak 1,727 MiB allocated"
