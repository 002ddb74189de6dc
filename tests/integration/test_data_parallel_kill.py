"""Data-parallel training on a CPU (2 gloo processes): a rank killed by SIGKILL is the one the FAILED run
names. (Its own file, so that xdist runs it beside the other data-parallel tests.)"""
from __future__ import annotations

import pytest

from .conftest import runs
from .test_data_parallel import train_and_act_at_step_2, two_process_project

pytestmark = pytest.mark.slow


def test_a_rank_killed_outright_is_the_one_the_failed_run_names(tmp_path, prepared):
    """SIGKILL (as the kernel's out-of-memory killer sends it) to rank 1 mid-training: rank 0 then fails on
    the lost peer, but the run ends FAILED naming rank 1 and the signal, not rank 0's symptom."""
    import os
    import signal

    import psutil

    project = two_process_project(prepared, tmp_path, max_steps=40)

    def kill_rank1(p):
        (rank1,) = [c for c in psutil.Process(p.pid).children(recursive=True)
                    if c.environ().get("RANK") == "1" and "onegpu" in " ".join(c.cmdline())]
        os.kill(rank1.pid, signal.SIGKILL)
    p, out = train_and_act_at_step_2(project, kill_rank1)
    assert p.returncode == 2, out
    assert "training process rank 1 of 2 was killed by signal SIGKILL" in out, out
    _, _, all_runs = runs(project)
    (failed,) = [r for r in all_runs if r.data.tags.get("stage") == "train"]
    assert failed.info.status == "FAILED", out
    assert (failed.data.tags["error.rank"], failed.data.tags["error.exitcode"]) == ("1", "-9")
    assert "out-of-memory killer" in failed.data.tags["error.message"]
