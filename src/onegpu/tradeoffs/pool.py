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
        data_key: ``row overrides -> key`` of the prepared data a row trains on (:meth:`ready` prepares
            each key once per worker; None: one per worker).
    """

    def __init__(self, params: str, group, offline: bool, target=None, data_key=None) -> None:
        self.params, self.group, self.offline, self.target = params, group, offline, target
        self.data_key = data_key
        self._ctx = multiprocessing.get_context("spawn")
        self._workers: dict[str, tuple] = {}
        self._ready: set[tuple[str, str]] = set()  # (worker key, prepare key) made ready
        self._asked: list[str] = []  # the workers asked to get ready that have not answered yet
        self.ready_s = 0.0  # seconds :meth:`ready` waited, in all

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

    def ask(self, rows: list[list[str]]) -> None:
        """Start the worker each of ``rows`` (their ``key=value`` overrides) needs and ask it to get ready
        for them (import what training imports, prepare their data), without waiting: the command goes on
        planning meanwhile. Each (worker, data) pair is asked once."""
        for overrides in rows:
            key = self.group(overrides)
            data = self.data_key(overrides) if self.data_key else ""
            if (key, data) not in self._ready:
                self._ready.add((key, data))
                self._worker(key)[1].send({"name": None, "prepare": True, "params": self.params,
                                           "overrides": overrides})
                self._asked.append(key)

    def ready(self, rows: list[list[str]]) -> float:
        """:meth:`ask` for ``rows``, then wait until every worker asked is ready: the workers start at once
        (on two cores two workers start in the time of one) and no row's wall time holds a worker's start.
        Return the seconds waited (0.0 when nothing was left to wait for).

        Raises:
            onegpu.tradeoffs.rows.Stopped: Ctrl-C or SIGTERM meanwhile (the workers stopped).
        """
        import time
        t0 = time.monotonic()
        self.ask(rows)
        waited_for = bool(self._asked)
        try:
            while self._asked:
                key = self._asked[0]
                try:
                    self._workers[key][1].recv()
                except EOFError:  # it died getting ready: its row gets a new worker and fails or trains there
                    p, _ = self._workers.pop(key)
                    p.join()
                    self._asked = [k for k in self._asked if k != key]
                    self._ready = {r for r in self._ready if r[0] != key}
                    continue
                self._asked.pop(0)
        except KeyboardInterrupt as e:
            self._asked.clear()
            for key in list(self._workers):
                self._stop(key, told=not isinstance(e, Terminated))
            raise Stopped() from None
        waited = time.monotonic() - t0 if waited_for else 0.0
        self.ready_s += waited
        return waited

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
        """Ask each worker to end (after its row), then make sure it has; one still getting ready (the
        command refused its rows meanwhile) is killed: it has no run open."""
        for key in set(self._asked):
            p, _ = self._workers.pop(key)
            p.kill()
            p.join()
        self._asked.clear()
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
    before each row's own overrides), one at a time (:func:`onegpu.tradeoffs.rows.one_at_a_time`), once
    every worker they need is ready (:meth:`Pool.ready`).

    Returns:
        ``(ran, interrupted)``: the rows that ran or were stopped, in order (a stopped one with
        returncode None), and whether Ctrl-C or SIGTERM stopped the batch.
    """
    return one_at_a_time(prefix, rows, lambda name, v: pool.train(name, [*window, *v.assignments]),
                         before=lambda: pool.ready([[*window, *v.assignments] for v in rows]))


def for_batch(cfg, params: str, facts, steps: int | None, no_rows: bool, overrides=None):
    """The :class:`Pool` of a batch's probe rows, or a null context when its rows run as ``dvc exp run
    --temp`` (``steps`` None: ``--full``; several data-parallel processes: torchrun) or none run here
    (``no_rows``: ``--queue-only``, ``--report``). ``cfg``: the params with the command's ``-S``
    (``overrides``: the baseline's worker starts getting ready for them at once, while the rows are
    planned: :meth:`Pool.ask`); ``facts``: the machine (on a CPU, rows with another
    ``train.cpu_allocator`` get their own worker)."""
    import contextlib
    if no_rows or steps is None or cfg.train.num_processes > 1:
        return contextlib.nullcontext()
    from onegpu.config import load
    from onegpu.models import loader
    from onegpu.tradeoffs.worker import prepare_key

    def group(overrides: list[str]) -> str:  # the host allocator is process-wide (a CPU training only)
        return "" if facts.cuda else load(params, overrides).train.cpu_allocator
    pool = Pool(params, group, offline=loader.is_local(cfg.model.name_or_path),
                data_key=lambda overrides: prepare_key(load(params, overrides)))
    if overrides is not None:
        pool.ask([list(overrides)])
    return pool
