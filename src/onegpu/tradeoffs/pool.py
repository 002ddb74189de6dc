"""The probe rows of ``onegpu tradeoffs`` in long-lived worker processes (:mod:`onegpu.tradeoffs.worker`),
one row at a time: no DVC clone, stage process start, import and data preparation per row.

A row that runs ``dvc exp run --temp`` pays DVC's clone, three stage processes (each importing torch,
transformers and MLflow), the model's save and DVC's commit on top of its training, whatever its window.
Here a worker imports once, prepares the data once per set of prepare's params, and trains each row it is
sent into the same MLflow run the train stage makes. Workers are keyed by what is process-wide and cannot
be undone in a process: the host allocator (``train.cpu_allocator``, on a CPU), so its row gets a worker
of its own, started once. Workers are started with ``spawn`` (a fresh interpreter, no state inherited,
CUDA initialised in the worker only).

Ctrl-C reaches the workers too (the terminal signals the whole foreground process group): the row
training ends its MLflow run KILLED and its worker ends; SIGTERM, sent to this process alone, is passed on
to the worker as SIGINT (:func:`onegpu.tradeoffs.queue.run_rows` does the same for ``dvc exp run``).
"""
from __future__ import annotations

import multiprocessing
import os
import signal
import time

from onegpu.tradeoffs.knobs import Variant
from onegpu.tradeoffs.queue import Ran, time_left

# A batch's plan says "runner": WORKERS when its rows trained here.
WORKERS = "workers"


class _Terminated(KeyboardInterrupt):
    """SIGTERM, sent to this process alone: the workers did not get it."""


def _raise_interrupt(signum, frame):
    raise _Terminated()


class Pool:
    """Workers by process-wide setting, started on first use; ``with Pool(...) as pool`` stops them.

    Args:
        params: the params file the rows' overrides apply to.
        group: ``row overrides -> key`` of the worker a row needs (rows with one key share a worker).
        offline: the model is local: the workers make no hub lookups.
        target: the workers' loop, ``(conn, offline) -> None`` (None: :func:`onegpu.tradeoffs.worker.main`;
            a test's stand-in otherwise).
    """

    def __init__(self, params: str, group, offline: bool, target=None) -> None:
        self.params, self.group, self.offline, self.target = params, group, offline, target
        self._ctx = multiprocessing.get_context("spawn")
        self._workers: dict[str, tuple] = {}

    def __enter__(self) -> "Pool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _worker(self, key: str):
        if key not in self._workers:
            from onegpu.tradeoffs import worker
            ours, theirs = self._ctx.Pipe()
            # Not a daemon: a row may start processes of its own (DataLoader workers, inductor's compilers).
            p = self._ctx.Process(target=self.target or worker.main, args=(theirs, self.offline))
            p.start()
            theirs.close()
            self._workers[key] = (p, ours)
        return self._workers[key]

    def train(self, name: str, overrides: list[str]) -> Ran:
        """Train one row (MLflow run ``name``, ``key=value`` ``overrides``) in its worker; wait for it.

        Raises:
            KeyboardInterrupt: Ctrl-C or SIGTERM (after the row's worker has stopped it).
        """
        key = self.group(overrides)
        p, conn = self._worker(key)
        t0 = time.monotonic()
        conn.send({"name": name, "params": self.params, "overrides": overrides})
        try:
            reply = conn.recv()
        except EOFError:  # the worker died (killed, out of memory): the row failed, the next gets a new one
            self._workers.pop(key, None)
            p.join()
            return Ran(name, 1 if p.exitcode is None else (p.exitcode or 1), time.monotonic() - t0)
        except KeyboardInterrupt as e:
            self._stop(key, told=not isinstance(e, _Terminated))
            raise
        if reply["returncode"] is None:  # the worker got the terminal's Ctrl-C and ended
            self._workers.pop(key, None)
        return Ran(name, reply["returncode"], time.monotonic() - t0)

    def _stop(self, key: str, told: bool, grace_s: float = 60.0) -> None:
        """Stop ``key``'s worker mid-row: it had the terminal's Ctrl-C (``told``), else send SIGINT; give
        it 10 s (``told``) then ``grace_s`` to end its MLflow run KILLED, then kill it."""
        p, _ = self._workers.pop(key)
        try:
            if told:
                p.join(10.0)
            if p.is_alive():
                os.kill(p.pid, signal.SIGINT)
                p.join(grace_s)
        except KeyboardInterrupt:
            pass
        if p.is_alive():
            p.kill()
            p.join()

    def close(self) -> None:
        """Ask each worker to end (after its row), then make sure it has."""
        for p, conn in self._workers.values():
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for p, _ in self._workers.values():
            p.join(30.0)
            if p.is_alive():
                p.kill()
                p.join()
        self._workers.clear()


def run_rows(pool: Pool, prefix: str, rows: list[Variant], window: list[str]) -> tuple[list[Ran], bool]:
    """Each of ``rows`` in order in ``pool`` (MLflow run ``<prefix><row name>``; ``window``: ``key=value``
    before each row's own overrides), printing "row k of M" and the time left before each, as
    :func:`onegpu.tradeoffs.queue.run_rows` does for ``dvc exp run --temp`` rows.

    Returns:
        ``(ran, interrupted)``: the rows that ran or were stopped, in order (a stopped one with
        returncode None), and whether Ctrl-C or SIGTERM stopped the batch.
    """
    ran: list[Ran] = []
    old = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        for k, v in enumerate(rows, 1):
            name = f"{prefix}{v.name}"
            print(f"\nrow {k} of {len(rows)}: {name}  {v.set_text or '(your params)'}  "
                  f"({time_left(ran, len(rows) - k + 1)})", flush=True)
            t0 = time.monotonic()
            try:
                ran.append(pool.train(name, [*window, *(f"{key}={val}" for key, val in v.overrides)]))
            except KeyboardInterrupt:
                ran.append(Ran(name, None, time.monotonic() - t0))
                return ran, True
        return ran, False
    finally:
        signal.signal(signal.SIGTERM, old)


def for_batch(cfg, params: str, facts, steps: int | None, no_rows: bool):
    """The :class:`Pool` of a batch's probe rows, or a null context when its rows run as ``dvc exp run
    --temp`` (``steps`` None: ``--full``; several data-parallel processes: torchrun) or none run here
    (``no_rows``: ``--queue-only``, ``--report``). ``cfg``: the params with the command's ``-S``;
    ``facts``: the machine (on a CPU, rows with another ``train.cpu_allocator`` get their own worker)."""
    import contextlib
    if no_rows or steps is None or cfg.train.num_processes > 1:
        return contextlib.nullcontext()
    from onegpu import models
    from onegpu.config import load

    def group(overrides: list[str]) -> str:  # the host allocator is process-wide (a CPU training only)
        return "" if facts.cuda else load(params, overrides).train.cpu_allocator
    return Pool(params, group, offline=models.is_local(cfg.model.name_or_path))
