"""The DVC driver of ``onegpu tradeoffs``: run each row as ``dvc exp run --temp`` one at a time
(:func:`onegpu.tradeoffs.rows.one_at_a_time`: progress, time left, Ctrl-C stopping exactly the row it
started), or queue them (``--queue-only``) with their ``-S``
overrides; read the queue's states.

Each step is the ``dvc`` command in a subprocess: ``dvc.api`` shows and saves experiments (``exp_show``,
``exp_save``) but neither queues nor runs them; the CLI is also what the printed next commands use.
"""
from __future__ import annotations

import shutil
import signal
import subprocess
import sys
from pathlib import Path

from onegpu.errors import UserError
from onegpu.tradeoffs.knobs import Variant
from onegpu.tradeoffs.rows import Ran, Stopped, Terminated, one_at_a_time


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


def queue(prefix: str, variants: list[Variant], targets: list[str] = (), window: list[str] = ()) -> None:
    """``dvc exp run --queue`` each variant as experiment ``<prefix><variant name>`` (``targets``: the
    stages to reproduce, e.g. ``["train"]``; none: the whole pipeline; ``window``: ``-S`` arguments
    before the variant's own, e.g. the probe window's ``train.max_steps``).

    Raises:
        UserError: dvc could not queue one (its last line of output named).
    """
    for v in variants:
        name = f"{prefix}{v.name}"
        # The baseline's params may be what dvc.lock already holds: --force makes it train again instead of
        # finding nothing to do. Every other row changes a param of train, so train runs anyway and
        # prepare is reused when it is up to date.
        force = ["--force"] if v.knob == "baseline" else []
        p = call("exp", "run", "--queue", *force, "--name", name, *window, *v.set_args, *targets)
        if p.returncode != 0:
            last = (p.stderr.strip() or p.stdout.strip()).splitlines()[-1:] or ["?"]
            raise UserError(f"dvc could not queue experiment {name}: {last[0]}")
        print(f"  queued {name}  {v.set_text or '(your params)'}")


def states() -> dict[str, str]:
    """Each experiment of ``dvc queue status`` by name: ``Queued``, ``Running``, ``Failed``, ``Success``
    (DVC's words; a task stopped with ``dvc queue kill`` or ``dvc queue stop --kill`` shows ``Failed``)."""
    out = {}
    for line in call("queue", "status").stdout.splitlines():
        words = line.split()
        for w in ("Queued", "Running", "Failed", "Success"):
            if w in words and len(words) > 1:
                out[words[1]] = w
    return out


def _stop(p: subprocess.Popen, told: bool, grace_s: float = 60.0) -> None:
    """Stop ``p`` (a ``dvc exp run --temp``; the training in it saves its state and ends its MLflow run
    KILLED on SIGINT). ``told``: it had the terminal's Ctrl-C too (the whole foreground process group
    gets it), so give it 10 s to end by itself before a SIGINT of ours; SIGKILL after ``grace_s`` more or
    at another Ctrl-C."""
    try:
        try:
            if not told:
                raise subprocess.TimeoutExpired(p.args, 0)
            p.wait(10.0)
        except subprocess.TimeoutExpired:
            p.send_signal(signal.SIGINT)
            p.wait(grace_s)
    except (KeyboardInterrupt, subprocess.TimeoutExpired):
        p.kill()
        p.wait()


def run_rows(prefix: str, rows: list[Variant], targets: list[str], force: set[str] = frozenset(),
             window: list[str] = ()) -> tuple[list[Ran], bool]:
    """Run each of ``rows`` in order, one at a time, as ``dvc exp run --temp --name <prefix><row name>``
    (``targets``: e.g. ``["train"]``: the stages up to train only; ``force``: row names run with
    ``--force``; ``window``: ``-S`` arguments before each row's own), printing "row k of M" and the time
    left before each.

    ``--temp`` runs in a temporary clone in the foreground: no queue worker, nothing left queued, and
    Ctrl-C (or SIGTERM) stops exactly the experiment this command started.
    Returns:
        ``(ran, interrupted)``: the rows that ran or were stopped (in order), and whether the command was
        interrupted (the rows after the stopped one did not start).
    """
    def one(name: str, v: Variant) -> int:
        cmd = [dvc(), "exp", "run", "--temp", "--name", name, *(["--force"] if v.name in force else []),
               *window, *v.set_args, *targets]
        p = subprocess.Popen(cmd)
        try:
            return p.wait()
        except KeyboardInterrupt as e:
            _stop(p, told=not isinstance(e, Terminated))  # it may have finished meanwhile: rc 0
            raise Stopped(None if p.returncode != 0 else 0) from None
    return one_at_a_time(prefix, rows, one)
