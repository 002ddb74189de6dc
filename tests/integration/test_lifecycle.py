"""No MLflow run stays RUNNING without a process writing to it, whatever the sequence of stages,
interrupts, failures and parallel queued experiments (the run lifecycle of onegpu.tracking); the queued
grid's runs land complete in the root store."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from .conftest import BIN, _env, dvc, run, runs, set_train, wait_for_queue

# The team's store checker; never copied into the repo, so its assertion is skipped where it is absent.
CHECK_STORE = Path("/work/shared/tools/check_store.py")


def _train_runs(project: Path):
    c, exp, all_runs = runs(project)
    running = [(r.info.run_name, r.info.run_id) for r in all_runs if r.info.status == "RUNNING"]
    assert running == [], running
    return c, [r for r in all_runs if r.data.tags.get("stage") == "train"]


def _checkpoints(project: Path) -> list[Path]:
    return list((project / ".onegpu" / "checkpoints").glob("*/checkpoint-*"))


def test_no_run_is_left_running_after_stages_interrupts_failures_and_a_parallel_queue(tmp_path, trained):
    """From the session's trained project (its `dvc repro` ran once for the suite). Its first steps are
    proven elsewhere: train alone ends its run SCHEDULED (test_data_parallel.py, test_tradeoffs_queue.py),
    and evaluate re-opens that run and ends it FINISHED (test_front_doors.py's resumed `make run`;
    tests/unit/tracking/test_lineage.py)."""
    project = trained(tmp_path)
    c, train = _train_runs(project)
    assert [r.info.status for r in train] == ["FINISHED"] and "test_loss" in train[0].data.metrics

    # Ctrl-C: SIGINT to dvc's process group while train runs.
    set_train(project, seed=7, max_steps=8)
    p = subprocess.Popen([str(BIN / "dvc"), "repro"], cwd=project, env={**_env(), "PYTHONUNBUFFERED": "1"},
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    seen = []
    for line in p.stdout:
        seen.append(line)
        if " | loss " in line:  # an optimizer step is done
            os.killpg(p.pid, signal.SIGINT)
            break
    seen.append(p.stdout.read())
    assert p.wait(timeout=300) != 0, "".join(seen)
    c, train = _train_runs(project)
    assert sorted(r.info.status for r in train) == ["FINISHED", "KILLED"], "".join(seen)
    assert len(_checkpoints(project)) == 1

    # A run that fails inside the stage: not even a micro-batch of 1 fits the budget.
    set_train(project, seed=8, per_device_train_batch_size="auto", effective_batch_size=8, memory_budget_gib=1e-6)
    failed = dvc(project, "repro", check=False)
    assert failed.returncode != 0 and "not even a micro-batch of 1 fits" in failed.stdout + failed.stderr
    c, train = _train_runs(project)
    assert sorted(r.info.status for r in train) == ["FAILED", "FINISHED", "KILLED"]

    # A queued grid of two experiments on two workers at once: the stopped configuration (it resumes) and
    # another micro-batch (2 x 2: another effective batch, another key). Both land complete in the root
    # store's experiment.
    set_train(project, seed=7, per_device_train_batch_size=4, effective_batch_size=None, memory_budget_gib=None)
    run(["git", "add", "-A"], project)
    run(["git", "commit", "-qm", "seed 7"], project)
    dvc(project, "exp", "run", "--queue", "-S", "train.per_device_train_batch_size=4,2")
    dvc(project, "queue", "start", "-j", "2")
    status = wait_for_queue(project)
    assert status.count("Success") == 2, status
    c, train = _train_runs(project)
    assert sorted(r.info.status for r in train) == ["FAILED", "FINISHED", "FINISHED", "FINISHED", "KILLED"]
    killed = [r for r in train if r.info.status == "KILLED"][0]
    assert killed.data.tags.get("onegpu.resumed_by") in {r.info.run_id for r in train}
    for r in train:
        if r.info.status == "FINISHED":
            assert "test_loss" in r.data.metrics, r.info.run_name
    queued = [r for r in train if r.data.tags.get("dvc.exp_name")]
    assert sorted(r.data.params["resolved.per_device_train_batch_size"] for r in queued) == ["2", "4"]
    assert c.search_runs(["0"], max_results=10) == []  # nothing leaked into the Default experiment
    for r in queued:
        assert r.info.status == "FINISHED" and "test_accuracy" in r.data.metrics, r.info.run_name
        assert "/.dvc/tmp/" not in r.info.artifact_uri and r.info.run_name == r.data.tags["dvc.exp_name"]
        # the resumed run carries the whole curve, from the killed run's steps on
        assert sorted(m.step for m in c.get_metric_history(r.info.run_id, "loss")) == list(range(1, 9))
    assert len({r.data.tags["equivalence_key"] for r in queued}) == 2  # effective batches 8 and 4
    shown = dvc(project, "exp", "show", "--json").stdout
    assert "test_accuracy" in shown and "per_device_train_batch_size" in shown
    assert _checkpoints(project) == []  # resumed and finished, or superseded: nothing left to resume
    if CHECK_STORE.is_file():
        check = subprocess.run([sys.executable, str(CHECK_STORE), str(project)], capture_output=True, text=True,
                               env=_env(), timeout=300)
        assert check.returncode == 0, check.stdout + check.stderr
