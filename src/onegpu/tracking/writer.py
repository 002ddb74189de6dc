"""Per-step metrics off the training thread: :class:`MetricBuffer` batches them, a background thread
writes the batches.

One synchronous ``log_metric`` per value costs ~3.5 ms on SQLite, a batch of 1,000 about 70 ms in all;
even batched, a flush inside the loop makes one optimizer step in every ``flush_every`` records wait for
the store (and, during an outage, for the client's retries). Here the training thread only appends to a
list and, every ``flush_every`` records, hands the batch to a queue; one writer thread takes batches in
order and writes each through the run's :class:`~onegpu.tracking.spool.SpoolingWriter` (so an outage
spools them, as any write). Every step lands, in the order logged.

Why not MLflow's own asynchronous logging (``log_batch(..., synchronous=False)``): its queue thread records
a failed batch's exception and drops the batch, where an outage here must spool it for ``onegpu sync``.
"""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

_CHUNK = 1000  # MLflow's log_batch takes at most 1,000 metrics


class MetricBuffer:
    """Collects per-step metrics of one run; a background thread writes them in batches.

    ``write(run_id, kind, items)``: the run's write path (:meth:`SpoolingWriter.write`).
    ``flush_every``: records (one per metric value) per hand-off; ``flush_seconds``: at most this long
    between hand-offs while steps arrive. :meth:`flush` waits until every record
    added so far is written or spooled: call it when the run ends, fails or is interrupted.
    """

    def __init__(self, write: Callable[[str, str, list], None], run_id: str, flush_every: int = 200,
                 flush_seconds: float = 30.0) -> None:
        self._write, self.run_id = write, run_id
        self.flush_every, self.flush_seconds = flush_every, flush_seconds
        self._items: list = []
        self._last = time.monotonic()
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._errors: list[Exception] = []
        self.logged = 0  # records handed to the writer thread

    def add(self, metrics: dict[str, float], step: int) -> None:
        """Record ``metrics`` (name -> value; None values are skipped) at optimizer ``step``, timestamped
        now (ms since the epoch). Never waits on the store."""
        ts = int(time.time() * 1000)
        self._items.extend([k, float(v), ts, step] for k, v in metrics.items() if v is not None)
        if len(self._items) >= self.flush_every or time.monotonic() - self._last > self.flush_seconds:
            self._hand_off()

    def _hand_off(self) -> None:
        if self._items and self._thread is None:
            self._thread = threading.Thread(target=self._drain, name=f"onegpu-metrics-{self.run_id[:8]}",
                                            daemon=True)
            self._thread.start()
        while self._items:
            chunk, self._items = self._items[:_CHUNK], self._items[_CHUNK:]
            self._queue.put(chunk)
            self.logged += len(chunk)
        self._last = time.monotonic()

    def _drain(self) -> None:
        while True:
            chunk = self._queue.get()
            try:
                if chunk is None:
                    return
                self._write(self.run_id, "metrics", chunk)
            except Exception as e:  # not an outage (those are spooled): re-raised by flush()
                self._errors.append(e)
            finally:
                self._queue.task_done()

    def flush(self) -> None:
        """Hand off what is buffered, wait until every record added so far is written (or spooled), and
        stop the writer thread (the next :meth:`add` that hands off starts another).

        Raises:
            Exception: the first error a background write raised since the last flush (not an outage).
        """
        self._hand_off()
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        if self._errors:
            err, self._errors = self._errors[0], []
            raise err
