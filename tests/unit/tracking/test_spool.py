"""Writes that survive an outage (onegpu.tracking.spool): what counts as an outage (by exception type),
the spool and its replay. Fake clients where the store's behaviour is the point."""
from __future__ import annotations

import json

import pytest
import requests
from mlflow.exceptions import MlflowException, RestException

from onegpu import tracking

# -- is_outage: by type, not by message ---------------------------------------------------------------

def _rest_wrapped(cause: Exception) -> MlflowException:
    """What MLflow's REST client raises for a transport failure: a plain MlflowException, chained."""
    try:
        try:
            raise cause
        except Exception as e:
            # As mlflow.utils.rest_utils raises it, without `from`: chained by __context__ only, the link
            # is_outage must follow (`from e` would set __cause__ and test another path).
            raise MlflowException(f"API request to http://h/api failed with exception {e}")  # noqa: B904
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
