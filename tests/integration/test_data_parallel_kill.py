"""Data-parallel training on a CPU (2 gloo processes): a rank killed by SIGKILL is the one the FAILED run
names. (Its own file, so that xdist runs it beside the other data-parallel tests.)"""
from __future__ import annotations

import pytest
import yaml

from .conftest import BIN, runs
from .test_data_parallel import TASKS

pytestmark = pytest.mark.slow


def test_a_rank_killed_outright_is_the_one_the_failed_run_names(tmp_path, prepared):
    """SIGKILL (as the kernel's out-of-memory killer sends it) to rank 1 mid-training: rank 0 then fails on
    the lost peer, but the run ends FAILED naming rank 1 and the signal, not rank 0's symptom."""
    import os
    import signal
    import subprocess

    import psutil

    from .conftest import _env
    project = prepared(tmp_path, TASKS["causal-lm"])
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["train"].update(num_processes=2, per_device_train_batch_size=4, gradient_accumulation_steps=1,
                           max_steps=40, learning_rate=1e-3, logging_steps=1)
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    p = subprocess.Popen([str(BIN / "onegpu"), "train"], cwd=project, env=_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in p.stdout:
        lines.append(line)
        if line.startswith("step 2/"):
            (rank1,) = [c for c in psutil.Process(p.pid).children(recursive=True)
                        if c.environ().get("RANK") == "1" and "onegpu" in " ".join(c.cmdline())]
            os.kill(rank1.pid, signal.SIGKILL)
            break
    out = "".join(lines) + p.communicate(timeout=300)[0]
    assert p.returncode == 2, out
    assert "training process rank 1 of 2 was killed by signal SIGKILL" in out, out
    _, _, all_runs = runs(project)
    (failed,) = [r for r in all_runs if r.data.tags.get("stage") == "train"]
    assert failed.info.status == "FAILED", out
    assert (failed.data.tags["error.rank"], failed.data.tags["error.exitcode"]) == ("1", "-9")
    assert "out-of-memory killer" in failed.data.tags["error.message"]
