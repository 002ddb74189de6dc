"""Tracking writes: what counts as an outage (by exception type), the spool, the background metric
writer, and the reachability probe. Fake clients where the store's behaviour is the point; the
module's shared SQLite store where the real write path is."""
from __future__ import annotations

import json
import socket
import threading
import time

import pytest
import requests
from mlflow.exceptions import MlflowException, RestException

from onegpu import net, tracking
from onegpu.errors import UserError


@pytest.fixture(scope="module")
def store(store_root):
    return tracking.connect("writes")


# -- is_outage: by type, not by message ---------------------------------------------------------------

def _rest_wrapped(cause: Exception) -> MlflowException:
    """What MLflow's REST client raises for a transport failure: a plain MlflowException, chained."""
    try:
        try:
            raise cause
        except Exception as e:
            raise MlflowException(f"API request to http://h/api failed with exception {e}")
    except MlflowException as wrapped:
        return wrapped


def _sqlite_locked() -> MlflowException:
    """What MLflow's SQL store raises when SQLite is locked (db/utils.py: OperationalError ->
    TEMPORARILY_UNAVAILABLE)."""
    from mlflow.protos.databricks_pb2 import TEMPORARILY_UNAVAILABLE
    return MlflowException("(sqlite3.OperationalError) database is locked", error_code=TEMPORARILY_UNAVAILABLE)


@pytest.mark.parametrize("err, outage", [
    (requests.exceptions.ConnectionError("refused"), True),
    (requests.exceptions.ReadTimeout("slow"), True),
    (ConnectionRefusedError(111, "Connection refused"), True),
    (_rest_wrapped(requests.exceptions.ConnectionError("Max retries exceeded")), True),
    (_rest_wrapped(requests.exceptions.RetryError("too many 503 error responses")), True),
    (_sqlite_locked(), True),
    (RestException({"error_code": "INTERNAL_ERROR", "message": "server's database went away"}), True),
    (RestException({"error_code": "TEMPORARILY_UNAVAILABLE", "message": "try later"}), True),
    # The server answered "this write is wrong": retrying it later cannot help, whatever the words.
    (RestException({"error_code": "INVALID_PARAMETER_VALUE", "message": "Connection refused to param"}), False),
    (MlflowException.invalid_parameter_value("value timed out of range"), False),
    (MlflowException("API request to x failed: Failed to establish a new key"), False),
    (ValueError("Connection refused"), False),
])
def test_is_outage_is_decided_by_exception_type(err, outage):
    assert tracking.is_outage(err) is outage


# -- the background metric writer ---------------------------------------------------------------------

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


class _DownClient:
    """A client whose writes fail with a connection error while ``down``; records what it applied."""

    def __init__(self):
        self.down, self.applied = True, []

    def _apply(self, what):
        if self.down:
            raise _rest_wrapped(requests.exceptions.ConnectionError("Connection refused"))
        self.applied.append(what)

    def log_batch(self, run_id, metrics=(), params=(), tags=(), synchronous=None):
        self._apply(("metrics", [m.step for m in metrics]) if metrics else ("tags", [t.key for t in tags]))

    def set_terminated(self, run_id, status):
        self._apply(("status", status))


def test_an_outage_spools_background_writes_in_order_and_the_next_write_replays_them(tmp_path, capsys):
    client = _DownClient()
    tr = tracking.Tracker(client=client, experiment_id="1", uri="http://u:pw@store:5000", spool_dir=tmp_path)
    run = tr.run("r1")
    buf = run.metric_buffer(flush_every=2)
    for step in range(1, 6):
        buf.add({"loss": float(step), "lr": 0.1}, step=step)
    buf.flush()  # no error: the outage is spooled
    records = [json.loads(ln) for ln in (tmp_path / "r1.jsonl").read_text().splitlines()]
    assert [(r["kind"], [it[3] for it in r["items"]]) for r in records] == [
        ("metrics", [1, 1]), ("metrics", [2, 2]), ("metrics", [3, 3]), ("metrics", [4, 4]), ("metrics", [5, 5])]
    err = capsys.readouterr().err
    assert err.count("is unreachable") == 1 and "pw" not in err and "onegpu sync" in err
    client.down = False
    run.end("SCHEDULED")  # replays the spool first, then writes the status
    assert client.applied == [("metrics", [s, s]) for s in range(1, 6)] + [("status", "SCHEDULED")]
    assert not (tmp_path / "r1.jsonl").exists()


# -- the reachability probe ----------------------------------------------------------------------------

def test_unreachable_names_the_refused_address_and_accepts_a_listener(monkeypatch):
    for var in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert net.unreachable(f"http://127.0.0.1:{port}", 2.0) is None
    assert net.unreachable(f"http://127.0.0.1:{port}", 2.0) == f"127.0.0.1:{port}: Connection refused"
    with pytest.raises(UserError, match=f"cannot be reached \\(127.0.0.1:{port}: Connection refused, 2 s"):
        tracking.check_reachable(f"http://127.0.0.1:{port}", timeout_s=2.0)


def test_unreachable_goes_through_the_proxy_the_request_would_use(monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: refused
    monkeypatch.setenv("http_proxy", f"http://127.0.0.1:{port}")
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    assert net.unreachable("http://store.invalid:5000", 2.0) == \
        f"127.0.0.1:{port} (the proxy for store.invalid): Connection refused"
