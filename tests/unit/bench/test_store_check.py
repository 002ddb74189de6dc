"""bench/store_check.py: a store that holds what the pipeline promises passes; each broken promise (a
per-step metric missing or at other steps, memory missing, a run not FINISHED, no prepare run) is named."""
from __future__ import annotations

import pytest

from bench import store_check


def _store(root, runs=({},), prepare=True):
    """A SQLite store at root/mlflow.db as `dvc repro` leaves it, with one training run per item of
    ``runs`` (``drop_metric``, ``skip_step_of``: a metric without step 2, ``status``). Returns the runs'
    short ids."""
    import mlflow
    from mlflow.tracking import MlflowClient
    mlflow.set_tracking_uri(f"sqlite:///{root}/mlflow.db")
    c = MlflowClient()
    exp = c.create_experiment("onegpu")
    if prepare:
        p = c.create_run(exp, tags={"stage": "prepare"})
        for k in store_check.PREPARE:
            c.log_metric(p.info.run_id, k, 1.0)
        c.set_terminated(p.info.run_id)
    return [_training_run(c, exp, **defect) for defect in runs]


def _training_run(c, exp, drop_metric=None, skip_step_of=None, status="FINISHED", steps=3) -> str:
    r = c.create_run(exp, tags={"equivalence_key": "k", "device": "cuda:0", "mlflow.source.git.commit": "abc"})
    rid = r.info.run_id
    for k in store_check.STEP_METRICS:
        for s in range(1, steps + 1):
            if k != drop_metric and not (k == skip_step_of and s == 2):
                c.log_metric(rid, k, 1.0, step=s)
    for k in (*store_check.TRAIN_SUMMARY, *store_check.EVAL_SUMMARY):
        c.log_metric(rid, k, 1.0)
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
