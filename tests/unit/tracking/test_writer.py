"""The background metric writer (onegpu.tracking.writer.MetricBuffer) through the store's write path."""
from __future__ import annotations

import threading
import time

import pytest
from mlflow.exceptions import MlflowException

from onegpu import tracking


@pytest.fixture(scope="module")
def store(store_root):
    return tracking.connect("writer")


# -- through the store's own write path --------------------------------------------------------------

def test_metric_writes_run_off_the_training_thread_and_land_in_order(store, monkeypatch):
    """A slow store (0.3 s per batch) never holds up ``add``: the loop only appends and hands off."""
    run_id = store.start_run("slow-store", tags={})
    real, seen = store.client.log_batch, []

    def slow(rid, metrics=(), params=(), tags=(), synchronous=None):
        if metrics:
            seen.append((threading.current_thread(), [m.step for m in metrics]))
            time.sleep(0.3)
        return real(rid, metrics=metrics, params=params, tags=tags, synchronous=synchronous)

    monkeypatch.setattr(store.client, "log_batch", slow)
    buf = store.metric_buffer(run_id, flush_every=4, flush_seconds=3600)
    t0 = time.perf_counter()
    slowest = 0.0
    for step in range(1, 13):  # 24 records: 6 hand-offs of 4
        s0 = time.perf_counter()
        buf.add({"loss": 1.0 / step, "grad_norm": float(step)}, step=step)
        slowest = max(slowest, time.perf_counter() - s0)
    assert slowest < 0.1, slowest  # a synchronous flush would take >= 0.3 s
    assert time.perf_counter() - t0 < 0.3 * 6
    buf.flush()  # waits for the writer
    assert buf.logged == 24
    assert all(t is not threading.current_thread() for t, _ in seen)
    assert [s for _, steps in seen for s in steps] == [s for s in range(1, 13) for _ in range(2)]
    monkeypatch.undo()
    assert [m.step for m in store.client.get_metric_history(run_id, "loss")] == list(range(1, 13))
    store.end_run(run_id)


def test_a_failed_background_write_is_raised_by_flush(store, monkeypatch):
    run_id = store.start_run("bad-write", tags={})

    def broken(*a, **k):
        raise MlflowException.invalid_parameter_value("metric value must be finite")

    monkeypatch.setattr(store.client, "log_batch", broken)
    buf = store.metric_buffer(run_id, flush_every=1)
    buf.add({"loss": 1.0}, step=1)  # written (and failing) in the background: add does not raise
    with pytest.raises(MlflowException, match="must be finite"):
        buf.flush()
    monkeypatch.undo()
    store.end_run(run_id)
