"""``onegpu summary`` (run by ``make run`` after ``dvc repro``): headline figures and the next commands."""
from __future__ import annotations

import json

from onegpu import cli, summary


def _write(tmp_path, name, data):
    (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / name).write_text(json.dumps(data))


def test_summary_prints_the_headline_and_the_next_commands(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text("train:\n"
                                          "  per_device_train_batch_size: 8\n"
                                          "  gradient_accumulation_steps: 2\n")
    _write(tmp_path, "metrics/train.json", {
        "train_loss": 1.3812, "train_samples_per_second": 17.21, "train_mem_peak_bytes": 1.25 * 2**30})
    _write(tmp_path, "metrics/eval.json", {"test_loss": 0.3012, "test_accuracy": 0.92})
    _write(tmp_path, "models/mlflow_run.json", {"run_id": "abc123"})
    assert cli.main(["summary"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == ("onegpu: done. Headline (metrics/*.json; every figure and per-step series in MLflow run "
                      "abc123):")
    assert out[1] == "  test:  accuracy 0.9200 | loss 0.3012"
    assert out[2] == "  train: loss 1.3812 | 17.2 samples/s | peak 1.25 GiB | 8 x 2 per optimizer step"
    text = "\n".join(out)
    for command in ("onegpu ui", "onegpu compare", "onegpu tradeoffs", "dvc exp run --queue", "dvc queue start -j 1",
                    "dvc exp show"):
        assert command in text, command


def test_summary_of_a_causal_lm_gives_perplexity(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _write(tmp_path, "metrics/train.json", {"train_loss": 5.0})
    _write(tmp_path, "metrics/eval.json", {"test_loss": 4.5, "test_perplexity": 90.0171})
    assert "  test:  perplexity 90.0 | loss 4.5000\n" in summary.text()


def test_summary_of_preference_tuning_sets_the_reward_accuracy_against_the_references_own(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _write(tmp_path, "metrics/train.json", {"train_loss": 0.59})
    _write(tmp_path, "metrics/eval.json", {"test_loss": 0.5077, "test_rewards/accuracies": 0.9375,
                                           "test_reference_accuracy": 0.90625, "test_rewards/margins": 0.4421})
    assert ("  test:  loss 0.5077 | reward accuracy 0.938 (the reference's own pairwise accuracy 0.906) | margin "
            "0.4421\n") in summary.text()


def test_summary_before_any_run_says_what_to_run(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text("tracking:\n  experiment_name: t\n")
    assert cli.main(["summary"]) == 2
    assert capsys.readouterr().err.strip() == ("onegpu summary: error: metrics/train.json is missing: run the "
                                               "pipeline first (make run, or dvc repro)")


def test_summary_after_a_stopped_training_names_its_checkpoint_not_a_pipeline_that_never_ran(tmp_path, monkeypatch,
                                                                                             capsys):
    """Issue 30: Ctrl-C in train (DVC had removed the old metrics) is no "run the pipeline first"."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))
    (tmp_path / "params.yaml").write_text("tracking:\n  experiment_name: t\n")
    ckpt = tmp_path / ".onegpu/checkpoints/9e22a04f/checkpoint-3"
    ckpt.mkdir(parents=True)
    (tmp_path / ".onegpu/checkpoints/9e22a04f/checkpoint-4").mkdir()  # cut off by a SIGKILL: never named
    _write(ckpt, "onegpu_state.json", {"step": 3, "rows": [], "run_id": "b505cc25"})
    assert cli.main(["summary"]) == 2
    assert capsys.readouterr().err.strip() == (
        "onegpu summary: error: metrics/train.json is missing: the last training was stopped after optimizer "
        "step 3 (MLflow run b505cc25; checkpoint .onegpu/checkpoints/9e22a04f/checkpoint-3): make run (or dvc "
        "repro) resumes it")


def test_summary_marks_the_speed_of_a_run_trained_under_outside_load(tmp_path, monkeypatch):
    """Issue 20 item 3: metrics/train.json carries train_outside_cpu_load only when the run trained
    under outside load; the summary marks the speed and says what the figure means."""
    monkeypatch.chdir(tmp_path)
    _write(tmp_path, "metrics/train.json", {"train_loss": 1.0, "train_samples_per_second": 2.5,
                                            "train_outside_cpu_load": 1.42})
    _write(tmp_path, "metrics/eval.json", {"test_loss": 0.5})
    lines = summary.text().splitlines()
    assert lines[2] == "  train: loss 1.0000 | 2.5 samples/s (under outside load)"
    assert lines[3].startswith("  measured under outside load: other processes kept 1.42 CPUs busy while it "
                               "trained, so its samples/s is not the cost of its settings alone")
    _write(tmp_path, "metrics/train.json", {"train_loss": 1.0, "train_samples_per_second": 2.5})
    assert "outside load" not in summary.text()
