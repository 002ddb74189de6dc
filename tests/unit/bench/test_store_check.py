"""bench/store_check.py: a store that holds what the pipeline promises passes; each broken promise (a
per-step metric missing or at other steps, memory missing, a run not FINISHED, no prepare run, a dataset input
missing or of other data, no logged model) is named."""
from __future__ import annotations

import pandas as pd
import pytest
from mlflow.entities import Metric

from bench import store_check
from onegpu import tracking

SPLITS = {s: pd.DataFrame({"text": [f"{s} {i}" for i in range(3 + k)], "label": [0, 1, 0][:1] * (3 + k)})
          for k, s in enumerate(("train", "validation", "test"))}
CONTEXTS = {"train": "training", "validation": "validation", "test": "evaluation"}


def _store(root, runs=({},), prepare=True):
    """A SQLite store at root/mlflow.db as `dvc repro` leaves it, with one training run per item of
    ``runs`` (``drop_metric``, ``skip_step_of``: a metric without step 2, ``status``; lineage: ``inputs``,
    the splits it logs, ``other_data``: its train split another table, ``model``: its logged model).
    Returns the runs' short ids."""
    import mlflow
    from mlflow.tracking import MlflowClient
    mlflow.set_tracking_uri(f"sqlite:///{root}/mlflow.db")
    c = MlflowClient()
    exp = c.create_experiment("onegpu")
    tr = tracking.Tracker(client=c, experiment_id=exp, uri=f"sqlite:///{root}/mlflow.db")
    if prepare:
        p = c.create_run(exp, tags={"stage": "prepare"})
        for k in store_check.PREPARE:
            c.log_metric(p.info.run_id, k, 1.0)
        for split, df in SPLITS.items():
            tr.log_dataset(p.info.run_id, df, f"bbcnews-{split}", "bbcnews", CONTEXTS[split], "label")
        c.set_terminated(p.info.run_id)
    return [_training_run(tr, exp, **defect) for defect in runs]


def _training_run(tr, exp, drop_metric=None, skip_step_of=None, status="FINISHED", steps=3,
                  inputs=("train", "validation", "test"), other_data=False, model=True) -> str:
    c = tr.client
    r = c.create_run(exp, tags={"equivalence_key": "k", "device": "cuda:0", "mlflow.source.git.commit": "abc"})
    rid = r.info.run_id
    for k in store_check.STEP_METRICS:
        for s in range(1, steps + 1):
            if k != drop_metric and not (k == skip_step_of and s == 2):
                c.log_metric(rid, k, 1.0, step=s)
    tables = {**SPLITS, **({"train": SPLITS["train"].iloc[:2]} if other_data else {})}
    logged = tr.log_data_inputs(rid, [(tables[s], f"bbcnews-{s}", CONTEXTS[s]) for s in inputs],
                                "data/processed@x.dir")
    model_id = tr.log_model(rid, tracking.ModelSpec("m", {"equivalence_key": "k"})) if model else None
    c.log_batch(rid, [Metric(k, 1.0, 0, 0) for k in store_check.TRAIN_SUMMARY])
    test = logged[-1] if "test" in inputs else None
    tr.log_metrics(rid, {k: 1.0 for k in store_check.EVAL_SUMMARY}, model_id=model_id, dataset=test)
    for k in (*store_check.RESOLVED, "train.seed"):
        c.log_param(rid, k, "1")
    c.set_terminated(rid, status)
    return rid[:8]


@pytest.fixture
def root(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return tmp_path


def test_a_complete_store_passes(root):
    _store(root)
    problems, facts = store_check.check(root, finished=True)
    assert problems == []
    assert facts["prepare_runs"] == 1
    assert [(r["status"], r["steps"], r["device"]) for r in facts["training_runs"]] == [("FINISHED", 3, "cuda:0")]


def test_each_broken_promise_is_named(root):
    mem, steps, scheduled = _store(root, runs=({"drop_metric": "mem_peak_bytes"}, {"skip_step_of": "grad_norm"},
                                              {"status": "SCHEDULED"}))
    problems, _ = store_check.check(root)
    want = [f"{mem}: per-step metric mem_peak_bytes missing", f"{steps}: grad_norm steps differ from loss steps"]
    assert len(problems) == 2 and all(any(p.endswith(w) for p in problems) for w in want), problems
    problems, _ = store_check.check(root, finished=True)
    assert any(p.endswith(f"{scheduled}: status SCHEDULED, not FINISHED (evaluate finishes the run)")
               for p in problems), problems


def test_no_store_no_prepare_run(root, capsys):
    assert store_check.main([str(root)]) == 1
    assert "no store at sqlite:///" in capsys.readouterr().out
    _store(root, prepare=False)
    problems, _ = store_check.check(root)
    assert problems == ["no prepare run (tag stage=prepare)"]


def test_each_broken_lineage_promise_is_named(root):
    no_val, other, no_model = _store(root, runs=({"inputs": ("train", "test")}, {"other_data": True},
                                                 {"model": False}))
    problems, _ = store_check.check(root, finished=True)
    want = [f"{no_val}: dataset input validation missing",
            f"{other}: dataset bbcnews-train (training) has digest ",  # not prepare's
            f"{no_model}: 0 logged models, not 1"]
    assert len(problems) == 3 and all(any(w in p for p in problems) for w in want), problems
