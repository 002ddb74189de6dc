"""Writes that survive an outage: what counts as one, the per-run spool file, and its replay.

A write the store cannot take *now* (:func:`is_outage`) is appended to ``<spool_dir>/<run_id>.jsonl``
and training goes on; the spool is replayed, in order, before that run's next write
(:class:`SpoolingWriter`) and by ``onegpu sync`` (:func:`replay_all`).

Ours because MLflow has no offline mode: during an outage its client retries, then raises, and the write is lost.
"""
from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path

from onegpu.errors import UserError
from onegpu.tracking.uri import redact

KINDS = ("metrics", "params", "tags", "status", "reopen")


def apply(client, run_id: str, kind: str, items: list) -> None:
    """Send one write in spool format to the store: ``kind`` is one of :data:`KINDS`; ``items`` are
    ``[key, value, timestamp_ms, step]`` (metrics; plus ``model_id, dataset_name, dataset_digest`` for a
    metric of a logged model on a dataset), ``[key, value]`` (params, tags) or ``[status]``.

    Raises:
        ValueError: an unknown ``kind``; else whatever the MLflow client raises.
    """
    from mlflow.entities import Metric, Param, RunTag
    if kind == "metrics":
        client.log_batch(run_id, metrics=[Metric(*item) for item in items], synchronous=True)
    elif kind == "params":
        client.log_batch(run_id, params=[Param(k, v) for k, v in items], synchronous=True)
    elif kind == "tags":
        client.log_batch(run_id, tags=[RunTag(k, v) for k, v in items], synchronous=True)
    elif kind == "status":
        client.set_terminated(run_id, status=items[0])
    elif kind == "reopen":
        client.update_run(run_id, status=items[0])
    else:
        raise ValueError(f"unknown spool record kind {kind!r}")


def _transport_errors() -> tuple[type, ...]:
    import requests
    import urllib3
    return (requests.exceptions.ConnectionError, requests.exceptions.Timeout, requests.exceptions.RetryError,
            urllib3.exceptions.HTTPError, ConnectionError, TimeoutError)


def is_outage(e: BaseException) -> bool:
    """True when ``e`` means "the store is not there now", not "this write is wrong"; decided by type.

    An outage is: a transport error anywhere in the exception's chain (requests' ConnectionError,
    Timeout or RetryError, any urllib3 error, Python's ConnectionError or TimeoutError; MLflow's REST
    client re-raises these as a plain MlflowException, chained); an MlflowException with the code
    TEMPORARILY_UNAVAILABLE or DEADLINE_EXCEEDED (HTTP 503/504, and SQLAlchemy's OperationalError such
    as SQLite's "database is locked", which MLflow's SQL store maps to TEMPORARILY_UNAVAILABLE); or a
    RestException, i.e. the server's own answer, with an HTTP status of 500 or more.
    """
    from mlflow.exceptions import MlflowException, RestException
    transport = _transport_errors()
    seen: set[int] = set()
    err: BaseException | None = e
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, transport):
            return True
        if isinstance(err, MlflowException) and (
                err.error_code in ("TEMPORARILY_UNAVAILABLE", "DEADLINE_EXCEEDED")
                or (isinstance(err, RestException) and err.get_http_status_code() >= 500)):
            return True
        err = err.__cause__ or err.__context__
    return False


class Spool:
    """``<spool_dir>/<run_id>.jsonl``: one JSON line per write that could not reach the store."""

    def __init__(self, spool_dir: Path, run_id: str) -> None:
        self.path = Path(spool_dir) / f"{run_id}.jsonl"
        self.run_id = run_id

    def pending(self) -> bool:
        return self.path.is_file() and self.path.stat().st_size > 0

    def append(self, kind: str, items: list) -> None:
        """Add one write (fsynced: it survives a crash right after)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps({"kind": kind, "items": items}) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def replay(self, client) -> int:
        """Write every spooled record in order; the file is removed once all are in. Returns records
        written. Raises what the store raises (the rest stays spooled)."""
        lines = [ln for ln in self.path.read_text().splitlines() if ln.strip()]
        done = 0
        try:
            for ln in lines:
                rec = json.loads(ln)
                apply(client, self.run_id, rec["kind"], rec["items"])
                done += 1
        finally:
            rest = lines[done:]
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text("".join(ln + "\n" for ln in rest))
            os.replace(tmp, self.path)
            if not rest:
                self.path.unlink()
        return done


class SpoolingWriter:
    """The one path of every run write (params, tags, metrics, status) to the store.

    ``spool_dir`` None: writes go straight through and raise on failure. Else a write the store cannot
    take (:func:`is_outage`) is spooled and the first such outage is reported once on stderr. Writes are
    serialised by a lock, so the background metric writer and the stage's own writes never interleave
    in the spool.
    """

    def __init__(self, client, uri: str, spool_dir: Path | None) -> None:
        self.client, self.uri, self.spool_dir = client, uri, spool_dir
        self._lock = threading.Lock()
        self._warned = False

    def write(self, run_id: str, kind: str, items: list) -> None:
        """One batched write of ``kind`` (:data:`KINDS`) to ``run_id``: this run's spool first, if any.

        Raises:
            Exception: what the store raises when it is not an outage (or always, without a spool).
        """
        with self._lock:
            if self.spool_dir is None:
                apply(self.client, run_id, kind, items)
                return
            spool = Spool(self.spool_dir, run_id)
            try:
                if spool.pending():
                    spool.replay(self.client)
                apply(self.client, run_id, kind, items)
            except Exception as e:
                if not is_outage(e):
                    raise
                spool.append(kind, items)
                self._warn(e, spool)

    def _warn(self, e: Exception, spool: Spool) -> None:
        if not self._warned:
            self._warned = True
            print(f"onegpu: the MLflow store {redact(self.uri)} is unreachable ({type(e).__name__}); "
                  f"spooling to {spool.path}; later writes retry it, `onegpu sync` writes the rest",
                  file=sys.stderr, flush=True)


def replay_all(client, uri: str, spool_dir: Path) -> tuple[int, int]:
    """Replay every run's spool in ``spool_dir`` into the store. Returns (runs, records) written.

    Raises:
        UserError: the store is unreachable (the rest of the spool is kept).
    """
    runs = records = 0
    for f in sorted(Path(spool_dir).glob("*.jsonl")):
        try:
            records += Spool(f.parent, f.stem).replay(client)
        except Exception as e:
            if is_outage(e):
                raise UserError(f"the MLflow store {redact(uri)} is still unreachable; the spool is kept "
                                f"in {f.parent}") from None
            raise
        runs += 1
    return runs, records
