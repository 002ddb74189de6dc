"""The background metric writer (onegpu.tracking.writer.MetricBuffer): the training thread only appends,
one thread writes the batches in order, flush waits and re-raises. A recording write function where the
store does not matter; the module's SQLite store where the real write path is."""
from __future__ import annotations

import threading
import time

import pytest
from mlflow.exceptions import MlflowException

from onegpu import tracking
from onegpu.tracking.writer import MetricBuffer


@pytest.fixture(scope="module")
def store(store_root):
    return tracking.connect("writer")


class Recorder:
    """A write function that records each batch (kind, [step, ...] per record, thread), optionally slow."""

    def __init__(self, delay: float = 0.0, gate: threading.Event | None = None):
        self.batches, self.delay, self.gate = [], delay, gate

    def __call__(self, run_id, kind, items):
        if self.gate is not None:
            self.gate.wait(10)
        time.sleep(self.delay)
        self.batches.append((kind, [it[3] for it in items], [it[0] for it in items], threading.current_thread()))


def test_records_go_in_batches_of_at_most_mlflows_1000_in_the_order_added():
    rec = Recorder()
    buf = MetricBuffer(rec, "r1", flush_every=2500, flush_seconds=3600)
    for step in range(1, 1301):  # 2,600 records of 2 metrics: one hand-off at 2,500, the rest at flush
        buf.add({"loss": 1.0, "grad_norm": 2.0}, step)
    buf.flush()
    assert [len(steps) for _, steps, _, _ in rec.batches] == [1000, 1000, 500, 100]
    assert [s for _, steps, _, _ in rec.batches for s in steps] == [s for s in range(1, 1301) for _ in (1, 2)]
    assert {kind for kind, *_ in rec.batches} == {"metrics"} and buf.logged == 2600
    assert all(t is not threading.current_thread() for *_, t in rec.batches)


def test_none_values_are_left_out_and_a_quiet_buffer_hands_off_after_flush_seconds():
    rec = Recorder()
    buf = MetricBuffer(rec, "r1", flush_every=100, flush_seconds=1.0)
    buf.add({"loss": 1.0, "grad_norm": None}, 1)
    assert rec.batches == [] and buf.logged == 0  # neither 100 records nor 1 s yet
    time.sleep(1.1)
    buf.add({"loss": 0.5}, 2)  # 1 s since the last hand-off: both records go
    assert buf.logged == 2  # handed to the writer thread by this add, not by a flush
    deadline = time.monotonic() + 30
    while not rec.batches and time.monotonic() < deadline:  # the writer thread writes it (on a loaded machine: soon)
        time.sleep(0.01)
    assert len(rec.batches) == 1
    buf.flush()
    assert [(steps, names) for _, steps, names, _ in rec.batches] == [([1, 2], ["loss", "loss"])]


def test_add_never_waits_on_a_blocked_store_and_flush_waits_for_every_record():
    gate = threading.Event()
    rec = Recorder(gate=gate)
    buf = MetricBuffer(rec, "r1", flush_every=2, flush_seconds=3600)
    t0 = time.perf_counter()
    for step in range(1, 21):  # 20 hand-offs of 2 records while the store answers nothing
        buf.add({"loss": float(step), "lr": 0.1}, step)
    assert time.perf_counter() - t0 < 0.5 and rec.batches == []
    done = threading.Thread(target=buf.flush)
    done.start()
    time.sleep(0.1)
    assert done.is_alive()  # flush waits for the writer ...
    gate.set()
    done.join(10)
    assert not done.is_alive() and len(rec.batches) == 20  # ... until every record is written


def test_after_a_flush_the_next_hand_off_starts_a_new_writer_and_an_error_is_raised_once():
    calls = []

    def write(run_id, kind, items):
        calls.append(threading.current_thread().name)
        if len(calls) == 1:
            raise ValueError("bad batch")
    buf = MetricBuffer(write, "abcdef123456", flush_every=1)
    buf.add({"loss": 1.0}, 1)
    with pytest.raises(ValueError, match="bad batch"):
        buf.flush()
    buf.add({"loss": 2.0}, 2)
    buf.flush()  # the error was raised once; the second writer thread wrote step 2
    assert len(calls) == 2 and calls[0].startswith("onegpu-metrics-abcdef12")


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
