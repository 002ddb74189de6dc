"""The DVC queue driver of ``onegpu tradeoffs``: queue experiments with their ``-S`` overrides, run the
queue one experiment at a time, wait until named experiments have left it.

Each step is the ``dvc`` command in a subprocess: ``dvc.api`` shows and saves experiments (``exp_show``,
``exp_save``) but neither queues nor runs them; the CLI is also what the printed next commands use.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

from onegpu.errors import UserError
from onegpu.tradeoffs.knobs import Variant


def dvc() -> str:
    """The ``dvc`` executable: next to this Python's (the project's venv), else on PATH."""
    local = Path(sys.executable).parent / "dvc"
    return str(local) if local.exists() else (shutil.which("dvc") or "dvc")


def call(*args: str) -> subprocess.CompletedProcess:
    """``dvc <args>``, its output captured."""
    return subprocess.run([dvc(), *args], capture_output=True, text=True)


def in_queue() -> list[str]:
    """Experiments queued or running in this project's DVC queue (``dvc queue status`` rows)."""
    p = call("queue", "status")
    rows = [line.split() for line in p.stdout.splitlines()]
    return [r[1] if len(r) > 1 else r[0] for r in rows if any(w in ("Queued", "Running") for w in r)]


def wait_for(names: set[str], poll_s: float = 3.0) -> None:
    """Until none of ``names`` is queued or running. ``dvc exp run --run-all`` can return at once while a
    queue worker of an earlier call, still alive, runs a task just queued (it found nothing queued)."""
    said = False
    while busy := [n for n in in_queue() if n in names]:
        if not said:
            print(f"waiting for {', '.join(busy)} (still in the DVC queue)", flush=True)
            said = True
        time.sleep(poll_s)


def queue(prefix: str, variants: list[Variant]) -> None:
    """``dvc exp run --queue`` each variant as experiment ``<prefix><variant name>``.

    Raises:
        UserError: dvc could not queue one (its last line of output named).
    """
    for v in variants:
        name = f"{prefix}{v.name}"
        # The baseline's params may be what dvc.lock already holds: --force makes it train again instead of
        # finding nothing to do. Every other row changes a param of train, so train runs anyway and
        # prepare is reused when it is up to date.
        force = ["--force"] if v.knob == "baseline" else []
        p = call("exp", "run", "--queue", *force, "--name", name, *v.set_args)
        if p.returncode != 0:
            last = (p.stderr.strip() or p.stdout.strip()).splitlines()[-1:] or ["?"]
            raise UserError(f"dvc could not queue experiment {name}: {last[0]}")
        print(f"  queued {name}  {v.set_text or '(your params)'}")


def run_all(names: set[str]) -> None:
    """Run every queued experiment, one at a time, following their logs (``dvc exp run --run-all -j 1``),
    and wait until ``names`` (the experiments this command queued) have left the queue."""
    print("running the queue one experiment at a time (dvc exp run --run-all -j 1); Ctrl+C stops following "
          "the logs, the experiments go on (then `onegpu tradeoffs --report`)", flush=True)
    subprocess.run([dvc(), "exp", "run", "--run-all", "-j", "1"])
    wait_for(names)
