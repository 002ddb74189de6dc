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
to the worker as SIGINT (:mod:`onegpu.tradeoffs.rows`).
"""
from __future__ import annotations

import multiprocessing
import os
import signal

from onegpu.tradeoffs.knobs import Variant
from onegpu.tradeoffs.rows import Ran, Stopped, Terminated, one_at_a_time

# A batch's plan says "runner": WORKERS when its rows trained here.
WORKERS = "workers"


def _worker_main(target, conn, offline: bool) -> None:
    """A worker's entry: SIGINT raises KeyboardInterrupt in it whatever this process was started with (a
    process started with SIGINT ignored, as a shell's background job or a test runner's worker, passes
    that on, and the worker would then outlive the SIGINT that stops its row), then ``target``."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    target(conn, offline)


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

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _worker(self, key: str):
        if key not in self._workers:
            from onegpu.tradeoffs import worker
            ours, theirs = self._ctx.Pipe()
            # Not a daemon: a row may start processes of its own (DataLoader workers, inductor's compilers).
            p = self._ctx.Process(target=_worker_main, args=(self.target or worker.main, theirs, self.offline))
            p.start()
            theirs.close()
            self._workers[key] = (p, ours)
        return self._workers[key]

    def train(self, name: str, overrides: list[str]) -> int:
        """Train one row (MLflow run ``name``, ``key=value`` ``overrides``) in its worker; wait for it and
        return its exit status (0 trained, 2 refused, else failed; a worker that died: its exit code).

        Raises:
            onegpu.tradeoffs.rows.Stopped: Ctrl-C or SIGTERM (after the row's worker has stopped it).
        """
        key = self.group(overrides)
        p, conn = self._worker(key)
        conn.send({"name": name, "params": self.params, "overrides": overrides})
        try:
            reply = conn.recv()
        except EOFError:  # the worker died (killed, out of memory): the row failed, the next gets a new one
            self._workers.pop(key, None)
            p.join()
            return p.exitcode or 1
        except KeyboardInterrupt as e:
            self._stop(key, told=not isinstance(e, Terminated))
            raise Stopped() from None
        if reply["returncode"] is None:  # the worker had a SIGINT of its own and ended
            self._workers.pop(key, None)
            raise Stopped()
        return reply["returncode"]

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
        for _, conn in self._workers.values():
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
    before each row's own overrides), one at a time (:func:`onegpu.tradeoffs.rows.one_at_a_time`).

    Returns:
        ``(ran, interrupted)``: the rows that ran or were stopped, in order (a stopped one with
        returncode None), and whether Ctrl-C or SIGTERM stopped the batch.
    """
    return one_at_a_time(prefix, rows, lambda name, v: pool.train(name, [*window, *v.assignments]))


def for_batch(cfg, params: str, facts, steps: int | None, no_rows: bool):
    """The :class:`Pool` of a batch's probe rows, or a null context when its rows run as ``dvc exp run
    --temp`` (``steps`` None: ``--full``; several data-parallel processes: torchrun) or none run here
    (``no_rows``: ``--queue-only``, ``--report``). ``cfg``: the params with the command's ``-S``;
    ``facts``: the machine (on a CPU, rows with another ``train.cpu_allocator`` get their own worker)."""
    import contextlib
    if no_rows or steps is None or cfg.train.num_processes > 1:
        return contextlib.nullcontext()
    from onegpu.config import load
    from onegpu.models import loader

    def group(overrides: list[str]) -> str:  # the host allocator is process-wide (a CPU training only)
        return "" if facts.cuda else load(params, overrides).train.cpu_allocator
    return Pool(params, group, offline=loader.is_local(cfg.model.name_or_path))
