"""`dvc repro` and `dvc exp run` on a tiny project, checked against the contract. (A queued grid on two
workers: test_lifecycle.py, whose queue also resumes an interrupted run. Another split of the effective
batch as the same training: in float64 by tests/unit/equivalence/test_same_training_classifier.py::
test_splits_of_the_classifiers_batch_are_the_same_training; through `dvc exp run train -S`, with the
experiment's MLflow run named after it, by test_causal_lm.py's experiment.)"""
from __future__ import annotations

import json

import pytest
import yaml

from .conftest import BIN, dvc, runs

STEP_METRICS = ("loss", "grad_norm", "learning_rate", "step_time_s", "samples_per_second",
                "tokens_per_second", "mem_peak_bytes")
MAX_STEPS = 3
EFFECTIVE = 8  # 4 x 2 in TINY


def _training_runs(project):
    c, exp, all_runs = runs(project)
    return c, exp, [r for r in all_runs if r.data.tags.get("stage") == "train"]


def test_repro_logs_prepare_and_one_complete_training_run(project):
    c, exp, all_runs = runs(project)
    assert exp.artifact_location == (project / "mlartifacts").as_uri()

    prep = [r for r in all_runs if r.data.tags.get("stage") == "prepare"]
    assert len(prep) == 1
    pm = prep[0].data.metrics
    assert pm["prepare_runtime"] > 0 and pm["prepare_rows_per_second"] > 0
    assert pm["prepare_mem_peak_bytes"] > 50 * 2**20  # a Python process with torch loaded
    assert pm["rows_read"] == 2225 and pm["duplicates_removed"] == 98
    assert (pm["rows_train"], pm["rows_validation"], pm["rows_test"]) == (24, 16, 16)
    assert len(c.get_run(prep[0].info.run_id).inputs.dataset_inputs) == 3

    train = [r for r in all_runs if r.data.tags.get("stage") == "train"]
    assert len(train) == 1
    run = c.get_run(train[0].info.run_id)
    assert run.info.status == "FINISHED"
    # Issue 33: the training run's datasets are prepare's (same names and digests; the UI links the runs),
    # with their contexts, the DVC-tracked source at its hash and the row counts; evaluate adds the test split.
    prepared = {d.dataset.name: d.dataset for d in c.get_run(prep[0].info.run_id).inputs.dataset_inputs}
    md5 = next(o["md5"] for o in yaml.safe_load((project / "dvc.lock").read_text())["stages"]["prepare"]["outs"]
               if o["path"] == "data/processed")
    got = {d.dataset.name: (d.dataset.digest, {t.key: t.value for t in d.tags}, d.dataset.source,
                            json.loads(d.dataset.profile)["num_rows"]) for d in run.inputs.dataset_inputs}
    assert got == {f"bbcnews-{s}": (prepared[f"bbcnews-{s}"].digest,
                                    {"mlflow.data.context": ctx, "onegpu.dvc_out": f"data/processed@{md5}"},
                                    prepared[f"bbcnews-{s}"].source, n)
                   for s, ctx, n in (("train", "training", 24), ("validation", "validation", 16),
                                     ("test", "evaluation", 16))}
    # The trained model as the run's logged model, its files where DVC keeps them (the tag names train's
    # DVC hash of models/), the evaluate metrics its own on the test dataset; in the store only its MLmodel.
    [model] = c.search_logged_models([exp.experiment_id])
    assert (model.source_run_id, str(model.status), model.model_type) == (
        run.info.run_id, "READY", "sequence-classification")
    assert [o.model_id for o in run.outputs.model_outputs] == [model.model_id]
    models_md5 = next(o["md5"] for o in yaml.safe_load((project / "dvc.lock").read_text())["stages"]["train"]["outs"]
                      if o["path"] == "models")
    assert model.tags["onegpu.dvc_out"] == f"models@{models_md5}" and model.tags["onegpu.model_dir"] == "models/model"
    assert model.params["equivalence_key"] == run.data.tags["equivalence_key"]
    assert (model.params["finetuning"], model.params["precision"]) == ("full", "fp32")
    linked = {m.key: (m.value, m.dataset_name, m.dataset_digest) for m in model.metrics}
    test_set = prepared["bbcnews-test"]
    assert linked["test_accuracy"] == (run.data.metrics["test_accuracy"], "bbcnews-test", test_set.digest)
    assert {k for k in linked} >= {"test_loss", "test_f1_macro", "test_runtime"}
    assert model.artifact_location.endswith(f"/mlartifacts/models/{model.model_id}/artifacts")
    from pathlib import Path
    stored = [f for f in Path(model.artifact_location[len("file://"):]).rglob("*") if f.is_file()]
    assert [f.name for f in stored] == ["MLmodel"] and stored[0].stat().st_size < 2_000
    for key in STEP_METRICS:
        history = c.get_metric_history(run.info.run_id, key)
        assert sorted(m.step for m in history) == list(range(1, MAX_STEPS + 1)), key
    for key in ("step_time_s", "samples_per_second", "tokens_per_second", "mem_peak_bytes", "grad_norm"):
        assert all(m.value > 0 for m in c.get_metric_history(run.info.run_id, key)), key
    # Every optimizer step sees the whole effective batch: samples/s x step time = 8 examples.
    sps = {m.step: m.value for m in c.get_metric_history(run.info.run_id, "samples_per_second")}
    dt = {m.step: m.value for m in c.get_metric_history(run.info.run_id, "step_time_s")}
    assert all(abs(sps[s] * dt[s] - EFFECTIVE) < 1e-6 for s in sps)

    m = run.data.metrics
    losses = [h.value for h in c.get_metric_history(run.info.run_id, "loss")]
    assert m["train_loss"] == pytest.approx(sum(losses) / len(losses), rel=1e-9)
    for key in ("train_runtime", "train_samples_per_second", "train_tokens_per_second", "train_mem_peak_bytes",
                "test_loss", "test_runtime", "test_samples_per_second", "test_mem_peak_bytes"):
        assert m[key] > 0, key
    assert 0.0 <= m["test_accuracy"] <= 1.0 and 0.0 <= m["test_f1_macro"] <= 1.0
    # The memory breakdown: every parameter trains (grads == params), AdamW keeps 2 states per parameter.
    assert m["mem_params_bytes"] > 80e6  # MiniLM-L6 + head: ~22.7 M float32 parameters
    assert m["mem_grads_bytes"] == m["mem_params_bytes"]
    assert m["mem_optimizer_bytes"] == 2 * m["mem_params_bytes"]
    assert m["mem_activation_bytes"] > 0 and m["mem_rss_peak_bytes"] >= m["train_mem_peak_bytes"]
    assert 0.0 < m["train_mfu"] <= 1.0 and m["train_flops_per_second"] > 0

    p = run.data.params
    assert p["train.gradient_accumulation_steps"] == "2"
    assert p["data.max_train_samples"] == "24"
    assert (p["resolved.per_device_train_batch_size"], p["resolved.gradient_accumulation_steps"],
            p["resolved.effective_batch_size"], p["resolved.world_size"]) == ("4", "2", "8", "1")
    t = run.data.tags
    assert len(t["equivalence_key"]) == 16 and t["device"] == "cpu"
    assert t["cpu_allocator"].startswith("caching (glibc mallopt")  # train.cpu_allocator's default, applied
    assert len(t["mlflow.source.git.commit"]) == 40
    arts = {a.path for a in c.list_artifacts(run.info.run_id)}
    assert "confusion_matrix.png" in arts
    # Nothing from the environment (paths, URIs, credentials) is logged as a param or tag.
    import os
    leaks = [v for v in [*p.values(), *t.values()] if str(BIN) in v or "MLFLOW_" in v
             or os.environ.get("HOME", "#") + "/" in v]
    assert leaks == []

    # What DVC reads: metrics files, the per-step plot, the run id.
    ev = json.loads((project / "metrics/eval.json").read_text())
    assert ev["test_accuracy"] == pytest.approx(m["test_accuracy"])
    # Headline figures only, so `dvc exp show` of a sweep stays narrow; the full set is in MLflow (above).
    assert set(ev) == {"test_loss", "test_accuracy"}
    tr = json.loads((project / "metrics/train.json").read_text())
    # + train_outside_cpu_load when other processes loaded the machine (tag onegpu.outside_load): a caution
    assert set(tr) - {"train_outside_cpu_load"} == {"train_loss", "train_samples_per_second", "train_mem_peak_bytes"}
    assert tr["train_loss"] == pytest.approx(m["train_loss"])
    steps = (project / "plots/train_steps.csv").read_text().splitlines()
    assert len(steps) == 1 + MAX_STEPS and steps[0].startswith("step,loss,")
    assert json.loads((project / "models/mlflow_run.json").read_text())["run_id"] == run.info.run_id
    assert (project / "models/model/model.safetensors").is_file()
    show = dvc(project, "metrics", "show", "--json").stdout
    assert "test_accuracy" in show

