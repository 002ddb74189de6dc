"""Two "machines" on loopback (issue 43, step 3): two `onegpu train` launchers, machine ranks 0 and 1 with one
process each, meeting at 127.0.0.1 (torchrun's static rendezvous, train.num_machines: 2), train as one machine's
2 processes: the same MLflow per-step losses and grad_norms, float64 from start-up (the faults folder's
``ONEGPU_TEST_DTYPE``), within 1e-12 relative (measured: equal). Only machine 0 writes the outputs and one MLflow
run. A rank that raises on machine 1 ends machine 0's run FAILED naming it (through the rendezvous store), with
rank 0's measured steps kept. (Its own file, so that xdist runs it beside the other data-parallel tests.)"""
from __future__ import annotations

import os
import subprocess

import pytest

from .conftest import BIN, _env, client, run, runs
from .test_data_parallel import _series, two_process_project
from .test_data_parallel_kill import FAULTS, _printed_steps

pytestmark = pytest.mark.slow

STEPS = 3


def _machines(port: int, rank: int) -> list[str]:
    """`onegpu train`'s options for machine ``rank`` of 2 meeting at 127.0.0.1:``port``."""
    return ["-S", "train.num_machines=2", "-S", f"train.machine_rank={rank}", "-S", "train.main_process_ip=127.0.0.1",
            "-S", f"train.main_process_port={port}"]


def _two_machines(project, port: int, env: dict) -> list[subprocess.CompletedProcess]:
    """`onegpu train` as machine 0 and machine 1 of 2 (one process each) in ``project``, both to their end."""
    procs = [subprocess.Popen([str(BIN / "onegpu"), "train", *_machines(port, r)], cwd=project, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    return [subprocess.CompletedProcess(p.args, p.returncode, out) for p, out in zip(procs, outs)]


def _float64_env(**more) -> dict:
    env = _env()
    env.update(ONEGPU_TEST_DTYPE="float64", PYTHONPATH=os.pathsep.join(filter(None, [str(FAULTS),
                                                                                     env.get("PYTHONPATH")])), **more)
    return env


def test_two_machines_of_one_process_train_as_one_machine_of_two_in_float64(tmp_path, prepared, monkeypatch):
    from tests.unit.training.test_distributed import _free_port
    project = two_process_project(prepared, tmp_path, max_steps=STEPS, backend="accelerate")
    monkeypatch.setenv("ONEGPU_TEST_DTYPE", "float64")
    monkeypatch.setenv("PYTHONPATH", _float64_env()["PYTHONPATH"])
    run([str(BIN / "onegpu"), "train"], cwd=project)  # the reference: one machine, 2 processes
    model_mtime = (project / "models" / "model" / "config.json").stat().st_mtime_ns
    zero, one = _two_machines(project, _free_port(), _float64_env())
    assert (zero.returncode, one.returncode) == (0, 0), zero.stdout[-3000:] + one.stdout[-3000:]
    assert "on machine 1 of 2, meeting at 127.0.0.1; machine 0 writes" in one.stdout, one.stdout
    assert "step 1/" not in one.stdout  # rank 0 prints the progress, on machine 0
    assert (project / "models" / "model" / "config.json").stat().st_mtime_ns > model_mtime  # machine 0 rewrote models/
    c, _, all_runs = runs(project)
    train = sorted((r for r in all_runs if r.data.tags.get("stage") == "train"), key=lambda r: r.info.start_time)
    assert len(train) == 2  # one run per training, none from machine 1
    assert len({r.data.tags["equivalence_key"] for r in train}) == 1
    for key in ("loss", "grad_norm"):
        ref, got = (_series(c, r.info.run_id, key) for r in train)
        assert len(ref) == STEPS
        assert max(abs(a - b) / abs(b) for a, b in zip(got, ref)) <= 1e-12, (key, got, ref)


def test_a_rank_failing_on_the_second_machine_is_the_one_the_failed_run_names(tmp_path, prepared):
    from tests.unit.training.test_distributed import _free_port
    project = two_process_project(prepared, tmp_path, max_steps=40, backend="accelerate")
    zero, one = _two_machines(project, _free_port(), _float64_env(ONEGPU_TEST_FAULT="raise:1:3"))
    assert (zero.returncode, one.returncode) == (2, 2), zero.stdout[-3000:] + one.stdout[-3000:]
    named = "training process rank 1 of 2 (machine 1) failed (RuntimeError: injected failure on rank 1 after"
    assert named in zero.stdout and named in one.stdout, zero.stdout[-3000:] + one.stdout[-3000:]
    _, _, all_runs = runs(project)
    (failed,) = [r for r in all_runs if r.data.tags.get("stage") == "train"]
    assert failed.info.status == "FAILED"
    assert failed.data.tags["error.rank"] == "1"
    logged = sorted(m.step for m in client(project).get_metric_history(failed.info.run_id, "loss"))
    # Rank 0's measured steps kept: those it printed (step 3 needs rank 1's figures, gathered after its end).
    assert logged == _printed_steps(zero.stdout) == [1, 2], (logged, zero.stdout[-3000:])
