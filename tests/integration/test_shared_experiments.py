"""Working as a team: an experiment pushed from one clone reproduces its eval metrics in another.

A bare git repository is the shared git remote and a local folder the DVC remote (S3, GCS or SSH take
the same commands with another URL). Clone A trains an experiment and pushes it (`dvc exp push`
carries its git commit and its cached outputs); clone B pulls it, applies it, `dvc pull`s and runs
`onegpu evaluate`. Each clone keeps its own MLflow store (`<clone>/mlflow.db`), so B logs into a run
linked to A's; with both pointing at one store (MLFLOW_TRACKING_URI) B logs into A's run itself.
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.integration.conftest import BIN, _env, dvc, run, runs

pytestmark = pytest.mark.slow

EXP = "shared-exp"
EXACT = ("test_accuracy", "test_f1_macro")
LOSS_RTOL = 1e-6  # the same model on the same rows: equal to float rounding (summation order per thread count)


def onegpu(project: Path, *args: str, tracking_uri: str | None = None) -> subprocess.CompletedProcess:
    env = _env()
    if tracking_uri:
        env["MLFLOW_TRACKING_URI"] = tracking_uri
    p = subprocess.run([str(BIN / "onegpu"), *args], cwd=project, env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, f"onegpu {' '.join(args)} exited {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p


def assert_same_eval(got: dict, want: dict) -> None:
    """Accuracy and macro F1 (where ``want`` has them: metrics/eval.json holds the headline only)
    exactly, test_loss to :data:`LOSS_RTOL`."""
    keys = [k for k in (*EXACT, "test_loss") if k in want]
    assert {"test_accuracy", "test_loss"} <= set(keys) <= set(got), (keys, sorted(got))
    for k in EXACT:
        if k in keys:
            assert got[k] == want[k], (k, got[k], want[k])
    assert got["test_loss"] == pytest.approx(want["test_loss"], rel=LOSS_RTOL)


def stale_stages(project: Path) -> str:
    """`dvc status` once the clone has its links (`dvc repro inputs`: a fresh clone lacks data/inputs/*,
    which point at this machine's packages; making them re-runs nothing else), "" when up to date."""
    dvc(project, "repro", "--single-item", "inputs")
    out = dvc(project, "status").stdout
    return out.replace("Data and pipelines are up to date.", "").strip()


def test_an_experiment_pushed_from_one_clone_reproduces_its_eval_metrics_in_another(tmp_path, prepared):
    origin, storage = tmp_path / "origin.git", tmp_path / "dvc-storage"
    run(["git", "init", "-q", "--bare", "-b", "main", str(origin)], tmp_path)

    # Clone A (its data prepared and committed): the project ships no DVC remote; the team adds one (-d:
    # the default) and commits it.
    a = prepared(tmp_path / "a")
    assert dvc(a, "remote", "list").stdout.strip() == ""
    dvc(a, "remote", "add", "-d", "storage", str(storage))
    run(["git", "add", ".dvc/config"], a)
    run(["git", "commit", "-qm", "DVC remote"], a)
    run(["git", "remote", "add", "origin", str(origin)], a)
    run(["git", "push", "-q", "origin", "main"], a)
    dvc(a, "exp", "run", "-n", EXP)
    pushed = dvc(a, "exp", "push", "origin", EXP)
    assert "Pushed experiment" in pushed.stdout, pushed.stdout
    assert any(storage.rglob("*")), "exp push uploaded no cached outputs"
    record = json.loads((a / "models/mlflow_run.json").read_text())
    assert record["tracking_uri"] == f"sqlite:///{a}/mlflow.db" and record["run_name"] == EXP
    client_a, _, runs_a = runs(a)
    trained = client_a.get_run(record["run_id"])
    assert trained.info.run_name == EXP and trained.info.status == "FINISHED"
    logged = trained.data.metrics
    assert set(EXACT) <= set(logged)

    # Clone B: pull the experiment, apply it, pull its data and model, evaluate.
    b = tmp_path / "b"
    run(["git", "clone", "-q", str(origin), str(b)], tmp_path)
    dvc(b, "exp", "pull", "origin", EXP)
    dvc(b, "exp", "apply", EXP)
    dvc(b, "pull")
    assert (b / "models/model/model.safetensors").is_file()
    assert json.loads((b / "models/mlflow_run.json").read_text()) == record
    assert stale_stages(b) == ""  # nothing to re-run: data, model and metrics are the experiment's
    pulled_eval = json.loads((b / "metrics/eval.json").read_text())

    out = onegpu(b, "evaluate").stdout
    assert f"the training run {record['run_id']} is not in this MLflow store" in out, out
    client_b, _, runs_b = runs(b)
    assert len(runs_b) == 1  # B's own store: one run, reproducing A's
    mine = runs_b[0]
    assert mine.info.status == "FINISHED" and mine.info.run_name == EXP
    assert mine.data.tags["onegpu.reproduces_run_id"] == record["run_id"]
    assert mine.data.tags["onegpu.reproduces_store"] == record["tracking_uri"]
    assert mine.data.tags["equivalence_key"] == trained.data.tags["equivalence_key"]
    assert mine.data.tags["device"] == trained.data.tags["device"]  # one machine here
    assert mine.data.params["train.max_steps"] == trained.data.params["train.max_steps"]
    assert_same_eval(mine.data.metrics, logged)
    assert_same_eval(json.loads((b / "metrics/eval.json").read_text()), pulled_eval)
    back = client_a.get_run(record["run_id"]).data.tags  # A's store is reachable here: the link back
    assert back["onegpu.reproduced_by"] == mine.info.run_id
    assert back["onegpu.reproduced_by_store"] == f"sqlite:///{b}/mlflow.db"
    repro = dvc(b, "repro").stdout  # evaluate rewrote the same metrics: nothing stale, nothing re-run
    for stage in ("prepare", "train", "evaluate"):
        assert f"Stage '{stage}' didn't change, skipping" in repro, repro

    # Both clones on one store (here A's; a team's server alike): B logs into A's run itself.
    onegpu(b, "evaluate", tracking_uri=record["tracking_uri"])
    _, _, after = runs(a)
    assert {r.info.run_id for r in after} == {r.info.run_id for r in runs_a}  # no new run in A's store
    again = client_a.get_run(record["run_id"])
    assert again.info.status == "FINISHED"
    assert_same_eval(again.data.metrics, logged)
    history = client_a.get_metric_history(record["run_id"], "test_accuracy")
    assert [m.value for m in history] == [logged["test_accuracy"]] * 2  # A's evaluation, then B's

    # Keeping the experiment: A commits it and pushes git and DVC; a fresh clone gets it with `dvc pull`.
    run(["git", "add", "dvc.lock", "metrics", "plots"], a)
    run(["git", "commit", "-qm", f"keep {EXP}"], a)
    run(["git", "push", "-q", "origin", "main"], a)
    dvc(a, "push")
    c = tmp_path / "c"
    run(["git", "clone", "-q", str(origin), str(c)], tmp_path)
    assert not (c / "models").exists()
    dvc(c, "pull")  # from the DVC remote: C's cache was empty
    assert json.loads((c / "models/mlflow_run.json").read_text()) == record
    assert (c / "data/processed").is_dir() and stale_stages(c) == ""
