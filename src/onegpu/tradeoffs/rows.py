"""A batch's rows one at a time, whatever runs them (``dvc exp run --temp``, :mod:`onegpu.tradeoffs.queue`;
a worker process, :mod:`onegpu.tradeoffs.pool`): "row k of M" and the time left before each, and Ctrl-C
or SIGTERM stopping exactly the row running and starting no other.

Ctrl-C reaches the row's process too (the terminal signals the whole foreground process group); SIGTERM,
sent to this process alone, does not: the runner is told which (:class:`Terminated`) and passes it on.
"""
from __future__ import annotations

import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

from onegpu.tradeoffs.knobs import Variant


@dataclass
class Ran:
    """One row: its name (the experiment's and the MLflow run's), exit status (None: stopped by Ctrl-C
    or SIGTERM before it ended) and wall-clock seconds (as DVC experiment: clone, stages, training,
    saving; in a worker: the model's build, training and the MLflow run)."""
    name: str
    returncode: int | None
    seconds: float


class Terminated(KeyboardInterrupt):
    """SIGTERM, sent to this process alone: the row's process did not get it."""


class Stopped(Exception):
    """Raised by a row's runner once it has stopped the row at Ctrl-C or SIGTERM; ``returncode``: None,
    or 0 when the row had finished meanwhile."""

    def __init__(self, returncode: int | None = None) -> None:
        super().__init__(returncode)
        self.returncode = returncode


def _raise_terminated(signum, frame):
    raise Terminated()


def duration(seconds: float) -> str:
    """``"3 min 20 s"`` (``"45 s"`` under a minute)."""
    s = round(seconds)
    return f"{s // 60} min {s % 60:02d} s" if s >= 60 else f"{s} s"


def time_left(done: list[Ran], left: int) -> str:
    """``"about 3 min 20 s left"`` from the mean wall time of the rows ``done`` times the ``left`` rows
    (``left`` includes the one about to start); before any row ended, what is not known yet."""
    if not done:
        return "time left: known after the first row"
    return f"about {duration(sum(r.seconds for r in done) / len(done) * left)} left"


def one_at_a_time(prefix: str, rows: list[Variant], run: Callable[[str, Variant], int],
                  before: Callable[[], float] | None = None) -> tuple[list[Ran], bool]:
    """Each of ``rows`` in order: print "row k of M" and the time left, then ``run(name, row)`` (``name``:
    ``<prefix><row name>``; returns the exit status; on a KeyboardInterrupt, :class:`Terminated` for
    SIGTERM, it stops its row and raises :class:`Stopped`). SIGTERM raises :class:`Terminated` meanwhile.
    ``before()``: called first (the workers' start; it may raise :class:`Stopped` as ``run`` does); the
    seconds it returns are printed when over one.

    Returns:
        ``(ran, interrupted)``: the rows that ran or were stopped, in order, and whether the batch was
        interrupted (the rows after the stopped one did not start).
    """
    ran: list[Ran] = []
    old = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        if before is not None:
            try:
                waited = before()
            except Stopped:
                return ran, True
            if waited >= 1.0:
                print(f"workers ready: {waited:.1f} s (started at once: Python, torch, transformers, MLflow and the "
                      "prepared data)", flush=True)
        for k, v in enumerate(rows, 1):
            name = f"{prefix}{v.name}"
            print(f"\nrow {k} of {len(rows)}: {name}  {v.set_text or '(your params)'}  "
                  f"({time_left([r for r in ran if r.returncode is not None], len(rows) - k + 1)})", flush=True)
            t0 = time.monotonic()
            try:
                rc = run(name, v)
            except Stopped as e:
                ran.append(Ran(name, e.returncode, time.monotonic() - t0))
                return ran, True
            ran.append(Ran(name, rc, time.monotonic() - t0))
        return ran, False
    finally:
        signal.signal(signal.SIGTERM, old)
