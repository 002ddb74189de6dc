"""Data-parallel training on a CPU (2 gloo processes), interrupted: SIGTERM stops both after the same
step and the next run resumes to the uninterrupted losses. (Its own file, so that xdist runs it beside
test_data_parallel.py.)"""
from __future__ import annotations

import pytest
import yaml

from .conftest import BIN, run, runs
from .test_data_parallel import _series, train_and_act_at_step_2, two_process_project

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("backend", ["trainer", "accelerate"])
def test_two_processes_stop_on_sigterm_and_resume_to_the_uninterrupted_losses(tmp_path, prepared, backend):
    """SIGTERM to `onegpu train` (as `dvc queue kill` sends it): the processes stop after the same step with
    one checkpoint, the run ends KILLED, and the next `onegpu train` resumes it on 2 processes to the
    losses of an uninterrupted run."""
    import os
    import signal

    steps = 8
    project = two_process_project(prepared, tmp_path, backend=backend, max_steps=steps)
    params = yaml.safe_load((project / "params.yaml").read_text())
    p, out = train_and_act_at_step_2(project, lambda p: os.kill(p.pid, signal.SIGTERM))
    assert p.returncode == 128 + signal.SIGTERM, out
    assert "checkpoint saved" in out, out
    c, _, all_runs = runs(project)
    (stopped,) = [r for r in all_runs if r.data.tags.get("stage") == "train"]
    assert stopped.info.status == "KILLED", out
    assert len(list((project / ".onegpu" / "checkpoints").glob("*/checkpoint-*"))) == 1, out

    resumed_out = run([str(BIN / "onegpu"), "train"], cwd=project).stdout
    assert "resuming from" in resumed_out, resumed_out
    params["train"].update(num_processes=1, per_device_train_batch_size=8)
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    run([str(BIN / "onegpu"), "train"], cwd=project)
    c, _, all_runs = runs(project)
    finished = sorted((r for r in all_runs if r.data.tags.get("stage") == "train" and r.info.status == "SCHEDULED"),
                      key=lambda r: r.info.start_time)
    assert len(finished) == 2
    resumed, reference = (_series(c, r.info.run_id, "loss") for r in finished)
    assert len(resumed) == len(reference) == steps
    assert resumed == pytest.approx(reference, rel=1e-5)
