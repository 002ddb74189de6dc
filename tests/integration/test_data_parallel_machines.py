"""Two "machines" on loopback (issue 43, step 3): two `onegpu train` launchers, machine ranks 0 and 1 with one
process each, meeting at 127.0.0.1 (torchrun's static rendezvous, train.num_machines: 2), train as one process of the
same 8 examples a step (``float64_reference``, which one machine's 2 processes equal in test_data_parallel.py): the
same MLflow per-step losses and grad_norms, float64 from start-up (the faults folder's ``ONEGPU_TEST_DTYPE``), within
1e-12 relative (measured: equal). Only machine 0 writes the outputs and one MLflow run; sharded over both (FSDP2, one
checkpoint folder) likewise. A rank that raises on machine 1 ends machine 0's run FAILED naming it (through the
rendezvous store), with rank 0's measured steps kept; with machine 1 in a copy of the project (its own disk), each
machine keeps its own checkpoint, and both resume from it. (Its own file, so that xdist runs it beside the other
data-parallel tests.)"""
from __future__ import annotations

import subprocess

import pytest

from .conftest import BIN, SPLIT_REFERENCE, assert_reference_steps, copy_project, float64_env, runs
from .test_data_parallel import two_process_project
from .test_data_parallel_kill import _printed_steps

pytestmark = pytest.mark.slow

STEPS = SPLIT_REFERENCE["max_steps"]


def _machines(port: int, rank: int) -> list[str]:
    """`onegpu train`'s options for machine ``rank`` of 2 meeting at 127.0.0.1:``port``."""
    return ["-S", "train.num_machines=2", "-S", f"train.machine_rank={rank}", "-S", "train.main_process_ip=127.0.0.1",
            "-S", f"train.main_process_port={port}"]


def _two_machines(projects, port: int, env: dict, *more: str) -> list[subprocess.CompletedProcess]:
    """`onegpu train` as machine 0 in ``projects[0]`` and machine 1 in ``projects[1]`` (the same folder: storage both
    machines share; another: machine 1's own disk), one process each, both to their end; ``more``: options of both."""
    procs = [subprocess.Popen([str(BIN / "onegpu"), "train", *_machines(port, r), *more], cwd=projects[r], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    return [subprocess.CompletedProcess(p.args, p.returncode, out) for p, out in zip(procs, outs)]


def test_two_machines_of_one_process_train_as_one_machine_of_two_in_float64(tmp_path, prepared, float64_reference):
    from tests.unit.training.parallel.test_distributed import _free_port
    ref = float64_reference()
    project = two_process_project(prepared, tmp_path, max_steps=STEPS, backend="accelerate")
    zero, one = _two_machines((project, project), _free_port(), float64_env())
    assert (zero.returncode, one.returncode) == (0, 0), zero.stdout[-3000:] + one.stdout[-3000:]
    assert "on machine 1 of 2, meeting at 127.0.0.1; machine 0 writes" in one.stdout, one.stdout
    assert "step 1/" not in one.stdout  # rank 0 prints the progress, on machine 0
    assert (project / "models" / "model" / "config.json").is_file()
    c, _, all_runs = runs(project)
    (train,) = [r for r in all_runs if r.data.tags.get("stage") == "train"]  # one run, none from machine 1
    assert train.data.tags["equivalence_key"] == ref["equivalence_key"]
    assert_reference_steps(c, train, ref)
    # Sharded over the two machines (FSDP2; the folder is one, as a sharded checkpoint needs): the same training.
    zero, one = _two_machines((project, project), _free_port(), float64_env(), *SHARDED)
    assert (zero.returncode, one.returncode) == (0, 0), zero.stdout[-3000:] + one.stdout[-3000:]
    assert "FSDP2 (fully_shard) over 2 processes" in zero.stdout, zero.stdout[-3000:]
    c, _, all_runs = runs(project)
    sharded = max((r for r in all_runs if r.data.tags.get("stage") == "train"), key=lambda r: r.info.start_time)
    assert "fsdp" in sharded.data.tags["config"] and sharded.data.tags["equivalence_key"] == ref["equivalence_key"]
    assert_reference_steps(c, sharded, ref)


# FSDP2 over the launch (out-of-memory retries are refused under it; the fused LM head on, as by default).
SHARDED = ("-S", "train.fsdp.enabled=true", "-S", "train.oom_retry=false")


def test_a_rank_failing_on_a_machine_with_its_own_disk_is_named_and_both_resume_their_own_checkpoints(
        tmp_path, prepared, float64_reference):
    """Machine 1 in a copy of the project (its own disk: it does not see machine 0's checkpoint folder), a checkpoint
    every 2 steps: rank 1 raising after step 3 ends the run FAILED naming it, with rank 0's printed steps kept, and
    each machine keeps the checkpoint of step 2 in its own folder; the same commands again resume both from it, to
    the one-machine run's per-step losses."""
    from tests.unit.training.parallel.test_distributed import _free_port
    project = two_process_project(prepared, tmp_path / "machine0", max_steps=STEPS, save_steps=2, backend="accelerate")
    other = copy_project(project, tmp_path / "machine1")
    zero, one = _two_machines((project, other), _free_port(), float64_env(ONEGPU_TEST_FAULT="raise:1:3"))
    assert (zero.returncode, one.returncode) == (2, 2), zero.stdout[-3000:] + one.stdout[-3000:]
    named = "training process rank 1 of 2 (machine 1) failed (RuntimeError: injected failure on rank 1 after"
    assert named in zero.stdout and named in one.stdout, zero.stdout[-3000:] + one.stdout[-3000:]
    c, _, all_runs = runs(project)
    (failed,) = [r for r in all_runs if r.data.tags.get("stage") == "train"]
    assert failed.info.status == "FAILED" and failed.data.tags["error.rank"] == "1"
    logged = sorted(m.step for m in c.get_metric_history(failed.info.run_id, "loss"))
    # Rank 0's measured steps kept: those it printed (step 3 needs rank 1's figures, gathered after its end).
    assert logged == _printed_steps(zero.stdout) == [1, 2], (logged, zero.stdout[-3000:])
    assert [_kept(p) for p in (project, other)] == [["checkpoint-2"], ["checkpoint-2"]]
    zero, one = _two_machines((project, other), _free_port(), float64_env())
    assert (zero.returncode, one.returncode) == (0, 0), zero.stdout[-3000:] + one.stdout[-3000:]
    assert "resuming after optimizer step 2" in zero.stdout, zero.stdout[-3000:]
    assert [_kept(p) for p in (project, other)] == [[], []]  # finished: both machines' folders removed
    c, _, all_runs = runs(project)
    resumed = max((r for r in all_runs if r.data.tags.get("stage") == "train"), key=lambda r: r.info.start_time)
    assert resumed.data.tags["onegpu.resumed_from"] == failed.info.run_id
    assert_reference_steps(c, resumed, float64_reference())


def _kept(project) -> list[str]:
    """The complete checkpoints under ``project``'s checkpoint folders."""
    return sorted(p.parent.name for p in (project / ".onegpu" / "checkpoints").glob("*/checkpoint-*/onegpu_state.json")
                  )
