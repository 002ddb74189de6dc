"""The SFT example end to end on the real packaged model: `dvc repro` of a tiny project with LoRA on
SmolLM2-135M-Instruct (converted from its GGUF in this test session's cache), BBC articles -> headlines,
completion-only loss, padding-free batches; two optimizer steps, evaluation with generation and ROUGE-L."""
from __future__ import annotations

import csv
import json

import pytest

from .conftest import dvc, make_project, runs

SFT = {
    "data": {"source": "bbcnews-headlines", "max_length": 96, "max_train_samples": 8, "max_eval_samples": 4,
             "padding_free": True},
    "model": {"task": "causal-lm", "name_or_path": "packaged:SmolLM2-135M-Instruct", "dropout": 0.0,
              "lora": {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": None}},
    "train": {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2, "max_steps": 2,
              "learning_rate": 3e-4, "logging_steps": 1},
    "evaluate": {"max_new_tokens": 8, "per_device_eval_batch_size": 4},
}


@pytest.mark.slow
def test_sft_on_the_packaged_smollm2_trains_evaluates_and_generates(tmp_path):
    from onegpu.models import packaged
    p = make_project(tmp_path, SFT)
    models = packaged.cache_root() / "models"  # the test run's cache, shared with the float64 proofs' workers
    converted_before = any(models.glob("SmolLM2-135M-Instruct-*/config.json"))
    out = dvc(p, "repro", timeout=1200)
    log = out.stdout + out.stderr
    # At most once, by the first stage that needs it (not at all when another worker's test converted it
    # first: the suite shares one cache); afterwards the copy is in the cache.
    converted = log.count("packaged model: model converted")
    assert converted == 0 if converted_before else converted <= 1, log
    assert log.count("packaged model: converting SmolLM2-135M-Instruct.Q4_1.gguf (") == converted + log.count(
        "packaged model: tokenizer converted")  # each conversion says what it converts, and ends
    assert any(models.glob("SmolLM2-135M-Instruct-*/config.json"))
    stats = json.loads((p / "data" / "stats.json").read_text())
    assert stats["format"] == "prompt-completion" and stats["rows_dropped"]["duplicate"] == 98
    ev = json.loads((p / "metrics" / "eval.json").read_text())
    assert set(ev) == {"test_loss", "test_perplexity", "test_rouge_l"} and 0 <= ev["test_rouge_l"] <= 1
    with open(p / "plots" / "generations.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 4 and all(r["reference"] for r in rows)
    client, _, found = runs(p)
    train = [r for r in found if r.data.tags.get("stage") == "train"]
    assert len(train) == 1 and train[0].info.status == "FINISHED"
    run = train[0]
    assert run.data.tags["model.class"] == "PeftModelForCausalLM"
    assert len(client.get_metric_history(run.info.run_id, "loss")) == 2
    # each step held its 4 examples (one flattened row per micro-batch) and only completion tokens as targets
    assert [m.value for m in client.get_metric_history(run.info.run_id, "step_examples")] == [4, 4]
    assert run.data.metrics["test_rouge_l"] == pytest.approx(ev["test_rouge_l"])
    arts = [a.path for a in client.list_artifacts(run.info.run_id)]
    assert "generations.json" in arts
    summary = dvc(p, "exp", "show", "--json").stdout  # the experiment table reads the headline metrics
    assert "test_rouge_l" in summary
