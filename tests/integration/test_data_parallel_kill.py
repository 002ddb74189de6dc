"""Data-parallel training on a CPU (2 gloo processes): a rank that fails, killed by SIGKILL or raising in
its own code, is the one the FAILED run names, and the run keeps every step rank 0 printed (torchrun's
closing SIGTERM reached rank 0 while it wrote the run's record: the run kept 0 steps in 5 of 6 tries).
(Its own file, so that xdist runs it beside the other data-parallel tests.) Both faults on both backends,
10 runs each, are in the issue's note; here each fault runs on one backend."""
from __future__ import annotations

import os
import re
import signal

import psutil
import pytest

from .conftest import FAULTS, runs, set_train
from .test_data_parallel import train_and_act_at_step_2, two_process_project


def _kill_rank1(p) -> None:
    (rank1,) = [c for c in psutil.Process(p.pid).children(recursive=True)
                if c.environ().get("RANK") == "1" and "onegpu" in " ".join(c.cmdline())]
    os.kill(rank1.pid, signal.SIGKILL)


def _printed_steps(out: str) -> list[int]:
    return sorted({int(m) for m in re.findall(r"^step (\d+)/", out, flags=re.M)})


# A failed rank is a front door of make test (one fault); the other fault, on the other backend, is make test-all's.
@pytest.mark.parametrize("backend, fault", [pytest.param("trainer", "sigkill", marks=pytest.mark.slow),
                                            ("accelerate", "raise")])
def test_a_failed_rank_is_the_one_the_failed_run_names_and_rank_0_keeps_every_step_it_printed(
        tmp_path, prepared, monkeypatch, backend, fault):
    """SIGKILL (as the kernel's out-of-memory killer sends it) to rank 1 mid-training, or rank 1 raising in
    the validation pass after optimizer step 3 (each rank validates its share): rank 0 then fails on the
    lost peer, but the run ends FAILED naming rank 1 (and the signal), not rank 0's symptom, with rank 0's
    steps."""
    project = two_process_project(prepared, tmp_path, max_steps=40)
    set_train(project, backend=backend, eval_steps=3)
    if fault == "raise":
        monkeypatch.setenv("ONEGPU_TEST_FAULT", "raise_validating:1:3")
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(FAULTS), os.environ.get("PYTHONPATH")])))
    p, out = train_and_act_at_step_2(project, _kill_rank1 if fault == "sigkill" else lambda p: None)
    assert p.returncode == 2, out
    assert "failed (exitcode" not in out and "closing signal" not in out, out  # torch elastic's, said by onegpu
    _, _, all_runs = runs(project)
    (failed,) = [r for r in all_runs if r.data.tags.get("stage") == "train"]
    assert failed.info.status == "FAILED", out
    if fault == "sigkill":
        assert "training process rank 1 of 2 was killed by signal SIGKILL" in out, out
        assert (failed.data.tags["error.rank"], failed.data.tags["error.exitcode"]) == ("1", "-9")
        assert "out-of-memory killer" in failed.data.tags["error.message"]
    else:
        assert ("training process rank 1 of 2 failed (RuntimeError: injected failure on rank 1 in the validation "
                "pass after optimizer step 3") in out, out
        assert failed.data.tags["error.rank"] == "1"
    from .conftest import client
    logged = sorted(m.step for m in client(project).get_metric_history(failed.info.run_id, "loss"))
    printed = _printed_steps(out)
    if fault == "raise":  # step 3 trained and logged; its progress line comes after the pass that failed
        assert (logged, printed) == ([1, 2, 3], [1, 2]), (logged, printed, out[-3000:])
    else:  # every printed step logged; the kill lands when the test reads step 2's line, which under load lags
        # rank 0: step 3 may then have trained (rank 1 still in it) and be logged, its line due after the
        # validation pass that rank 1's death cut (eval_steps 3; seen once in the suite on a loaded 2-core machine)
        assert printed and logged[:len(printed)] == printed and len(logged) - len(printed) <= (
            1 if logged[-1] % 3 == 0 else 0), (logged, printed, out[-3000:])
