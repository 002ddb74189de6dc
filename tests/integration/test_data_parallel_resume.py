"""Data-parallel training on a CPU (2 gloo processes), interrupted: SIGTERM stops both after the same
step and the next run resumes to the uninterrupted losses. (Its own file, so that xdist runs it beside
test_data_parallel.py.)"""
from __future__ import annotations

import pytest

from .conftest import BIN, SPLIT_REFERENCE, assert_reference_steps, float64_env, run, runs, series, set_train
from .test_data_parallel import train_and_act_at_step_2, two_process_project

pytestmark = pytest.mark.slow


STEPS = 20  # milliseconds a step: the SIGTERM sent after step 2 must land before the last one


@pytest.fixture(scope="module")
def reference(prepared, tmp_path_factory) -> list[float]:
    """The uninterrupted training's per-step losses: 1 process x 8 x 1 (HF Trainer), the same effective
    batch and data as the 2-process runs; one reference for both backends (each equals it per step:
    test_data_parallel.py)."""
    project = two_process_project(prepared, tmp_path_factory.mktemp("reference"), backend="trainer",
                                  max_steps=STEPS)
    set_train(project, num_processes=1, per_device_train_batch_size=8)
    run([str(BIN / "onegpu"), "train"], cwd=project)
    c, _, all_runs = runs(project)
    (finished,) = [r for r in all_runs if r.data.tags.get("stage") == "train"]
    return series(c, finished.info.run_id, "loss")


@pytest.mark.parametrize("backend", ["trainer", "accelerate"])
def test_two_processes_stop_on_sigterm_and_resume_to_the_uninterrupted_losses(tmp_path, prepared, backend,
                                                                              reference):
    """SIGTERM to `onegpu train` (as `dvc queue kill` sends it): the processes stop after the same step with
    one checkpoint, the run ends KILLED, and the next `onegpu train` resumes it on 2 processes to the
    losses of an uninterrupted run."""
    import os
    import signal

    project = two_process_project(prepared, tmp_path, backend=backend, max_steps=STEPS)
    p, out = train_and_act_at_step_2(project, lambda p: os.kill(p.pid, signal.SIGTERM))
    assert p.returncode == 128 + signal.SIGTERM, out
    assert "onegpu train: stopped by SIGTERM after optimizer step" in out and "kept the checkpoint of" in out, out
    c, _, all_runs = runs(project)
    (stopped,) = [r for r in all_runs if r.data.tags.get("stage") == "train"]
    assert stopped.info.status == "KILLED", out
    assert len(list((project / ".onegpu" / "checkpoints").glob("*/checkpoint-*"))) == 1, out

    resumed_out = run([str(BIN / "onegpu"), "train"], cwd=project).stdout
    assert "resuming from" in resumed_out, resumed_out
    c, _, all_runs = runs(project)
    (finished,) = [r for r in all_runs if r.data.tags.get("stage") == "train" and r.info.status == "SCHEDULED"]
    resumed = series(c, finished.info.run_id, "loss")
    assert len(resumed) == len(reference) == STEPS
    assert resumed == pytest.approx(reference, rel=1e-5)


# (backend, train.fsdp, the resume's processes and micro-batch, the clause its line ends with): the same 8 examples a
# step as the 2 processes x 4 x 1 that wrote the checkpoint.
OTHER_SPLITS = {
    "sharded-on-4": ("accelerate", True, 4, 2, "; written by 2 process(es) of 4 x 1, it goes on with 4 of 2 x 1: the "
                                               "same effective batch of 8, its shards redistributed on load"),
    "data-parallel-on-1": ("trainer", False, 1, 8, "; written by 2 process(es) of 4 x 1, it goes on with 1 of 8 x 1: "
                                                   "the same effective batch of 8"),
}


@pytest.mark.parametrize("case", list(OTHER_SPLITS))
def test_a_run_stopped_on_2_processes_resumes_on_another_number_to_the_uninterrupted_losses_in_float64(
        tmp_path, prepared, float64_reference, case):
    """2 processes x 4 x 1 (sharded with train.fsdp on the accelerate backend; data parallel on HF Trainer), a
    checkpoint every 2 steps, float64 from start-up: rank 1 raising after step 3 leaves the checkpoint of step 2;
    `onegpu train -S train.num_processes=N -S train.per_device_train_batch_size=M` (the same effective batch of 8)
    finds it, says how the split changed, and logs the uninterrupted run's per-step losses and grad_norms
    (``float64_reference``: one process of 8 x 1, which 2 processes equal in test_data_parallel.py) within 1e-12
    relative, as a run linked to the failed one."""
    import subprocess

    backend, fsdp, processes, micro, said = OTHER_SPLITS[case]
    project = two_process_project(prepared, tmp_path, max_steps=SPLIT_REFERENCE["max_steps"], save_steps=2,
                                  backend=backend, oom_retry=not fsdp, fsdp={"enabled": fsdp})
    failed = subprocess.run([str(BIN / "onegpu"), "train"], cwd=project, capture_output=True, text=True,
                            env=float64_env(ONEGPU_TEST_FAULT="raise:1:3"))
    assert failed.returncode == 2, failed.stdout[-3000:] + failed.stderr[-3000:]
    other = ["-S", f"train.num_processes={processes}", "-S", f"train.per_device_train_batch_size={micro}"]
    out = run([str(BIN / "onegpu"), "train", *other], cwd=project, env=float64_env()).stdout
    assert said in out, out[-3000:]
    c, _, all_runs = runs(project)
    stopped, resumed = sorted((r for r in all_runs if r.data.tags.get("stage") == "train"),
                              key=lambda r: r.info.start_time)
    assert stopped.info.status == "FAILED" and resumed.data.tags["onegpu.resumed_from"] == stopped.info.run_id
    assert [r.data.params["resolved.world_size"] for r in (stopped, resumed)] == ["2", str(processes)]
    assert_reference_steps(c, resumed, float64_reference())
    assert not list((project / ".onegpu" / "checkpoints").glob("*/checkpoint-*"))  # finished: nothing to resume
