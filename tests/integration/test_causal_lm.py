"""The causal-lm task end to end: a BPE tokenizer and a small GPT-2 built from params, perplexity,
and the exact step loss under two splits of the same effective batch on the two backends. The experiment
is also the front door of `dvc exp run train -S` for the suite (the classifier's splits as the same training:
in float64, tests/unit/equivalence/test_same_training_classifier.py): one new MLflow run, named after the
DVC experiment, tagged with it and its baseline commit."""
from __future__ import annotations

import json
import math

import pytest

from .conftest import dvc, run, runs

pytestmark = pytest.mark.slow

CAUSAL = {
    "data": {"max_train_samples": 32, "max_eval_samples": 16, "max_length": 48},
    "model": {"task": "causal-lm", "name_or_path": None, "n_layer": 2, "n_embd": 64, "n_head": 2,
              "vocab_size": 512, "dropout": 0.0},
    "train": {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "max_steps": 4,
              "learning_rate": 1e-3, "logging_steps": 1},
}


def test_causal_lm_from_config_trains_evaluates_and_is_exact_under_accumulation(tmp_path, trained):
    # `dvc repro` (prepare's BPE tokenizer, train, evaluate) ran once for the session: test_params_follow_stages.py
    # copies the same project.
    project = trained(tmp_path, CAUSAL)
    assert (project / "data/processed/tokenizer/tokenizer.json").is_file()
    ev = json.loads((project / "metrics/eval.json").read_text())
    assert ev["test_perplexity"] == pytest.approx(math.exp(ev["test_loss"]), rel=1e-9)
    assert 1.0 < ev["test_perplexity"] < 512 * 1.5  # near-uniform at worst after 4 steps
    assert set(ev) == {"test_loss", "test_perplexity"}  # the headline; the rest is in MLflow (below)
    # Trainer trains with use_cache off; the saved model keeps the model's own KV-cache setting.
    assert json.loads((project / "models/model/config.json").read_text())["use_cache"] is True

    # One experiment checks both the split and the backend: the Accelerate backend at 8 x 1 against HF
    # Trainer's 4 x 2 (the repro above). Rows padded per micro-batch to different lengths: only an exact
    # token-mean loss under accumulation, and the same steps on both backends, make the two agree.
    # (Each backend under accumulation alone: tests/unit/training/backends/test_base.py.)
    # Train only: evaluation does not depend on the backend that trained (checked on the repro's run).
    dvc(project, "exp", "run", "train", "-S", "train.backend=accelerate", "-S", "train.per_device_train_batch_size=8",
        "-S", "train.gradient_accumulation_steps=1")
    c, exp, all_runs = runs(project)
    train = sorted((r for r in all_runs if r.data.tags.get("stage") == "train"), key=lambda r: r.info.start_time)
    assert len(train) == 2
    hf, accel = train
    assert (hf.data.params["train.backend"], accel.data.params["train.backend"]) == ("trainer", "accelerate")
    assert accel.data.params["resolved.gradient_accumulation_steps"] == "1"
    # The experiment's run is named after it and tagged with it and its baseline; the repro's with neither.
    assert "dvc.exp_name" not in hf.data.tags and "dvc.baseline_rev" not in hf.data.tags
    assert accel.info.run_name == accel.data.tags["dvc.exp_name"]
    head = run(["git", "rev-parse", "HEAD"], project).stdout.strip()
    assert accel.data.tags["dvc.baseline_rev"] == head
    assert hf.data.tags["equivalence_key"] == accel.data.tags["equivalence_key"]
    assert hf.data.tags["model.class"] == "GPT2LMHeadModel"
    series = [[m.value for m in sorted(c.get_metric_history(r.info.run_id, "loss"), key=lambda m: m.step)]
              for r in train]
    assert len(series[0]) == len(series[1]) == 4
    assert max(abs(a - b) for a, b in zip(*series)) < 1e-5, series
    assert "test_perplexity" in hf.data.metrics and hf.data.metrics["test_tokens"] > 16
    assert accel.data.metrics["mem_optimizer_bytes"] == 2 * accel.data.metrics["mem_params_bytes"]
