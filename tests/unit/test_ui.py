"""``onegpu ui`` when the server cannot come up: a taken port fails at once naming it and ``--port``; a
server that stops or never answers is an error, never a printed link. The link opening the training runs
in a real browser: tests/integration/test_ui_browser.py."""
from __future__ import annotations

import socket
import sys
import time

import pytest

from onegpu import ui
from onegpu.errors import UserError


@pytest.fixture
def listening():
    """A port on 127.0.0.1 that another program listens on (and never answers)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        yield s.getsockname()[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_busy_port_fails_at_once_naming_the_port_and_the_option(fresh_root, listening, capsys):
    began = time.monotonic()
    with pytest.raises(UserError) as e:
        ui.serve("ui-exp", "127.0.0.1", listening)
    assert time.monotonic() - began < 10
    message = str(e.value)
    assert f"port {listening} on 127.0.0.1 is in use" in message and "--port" in message, message
    assert "http://" not in capsys.readouterr().out  # no link for a server that is not there
    assert not (fresh_root / "mlflow.db").exists()  # before any work: the store was not even opened


def test_an_unknown_host_fails_naming_the_option(fresh_root):
    with pytest.raises(UserError, match="--host no-such-host.invalid"):
        ui.serve("ui-exp", "no-such-host.invalid", _free_port())


@pytest.mark.parametrize("script, expected", [
    ("import sys; print('boom: cannot open the store', file=sys.stderr); sys.exit(3)",
     r"stopped before it served \(exit code 3\): boom: cannot open the store"),
    ("import sys; print('Application shutdown complete.', file=sys.stderr)",  # mlflow's exit 0 on a bind error
     r"stopped before it served \(exit code 0\): Application shutdown complete"),
    ("import time; time.sleep(60)", r"did not answer on http://127\.0\.0\.1:\d+ within 2 s"),
])
def test_a_server_that_never_serves_is_an_error_and_no_link(fresh_root, monkeypatch, capsys, script, expected):
    monkeypatch.setattr(ui, "_server_command", lambda uri, host, port: [sys.executable, "-c", script])
    monkeypatch.setattr(ui, "START_TIMEOUT_S", 2.0)
    began = time.monotonic()
    with pytest.raises(UserError, match=expected):
        ui.serve("ui-exp", "127.0.0.1", _free_port())
    assert time.monotonic() - began < 20  # the sleeping one is stopped, not waited for
    assert "http://" not in capsys.readouterr().out


def test_a_server_that_stops_after_serving_is_an_error(fresh_root, monkeypatch, capsys):
    """A server that answered, then stopped on its own: the command says so and exits non-zero."""
    port = _free_port()
    script = ("import http.server, threading, sys\n"
              "class H(http.server.BaseHTTPRequestHandler):\n"
              "    def do_GET(self):\n"
              "        self.send_response(200); self.end_headers(); self.wfile.write(b'OK')\n"
              "        threading.Timer(0.5, lambda: (print('worker died', file=sys.stderr, flush=True),"
              " __import__('os')._exit(1))).start()\n"
              "    def log_message(self, *a): pass\n"
              f"http.server.HTTPServer(('127.0.0.1', {port}), H).serve_forever()\n")
    monkeypatch.setattr(ui, "_server_command", lambda uri, host, p: [sys.executable, "-c", script])
    with pytest.raises(UserError, match=r"stopped on its own; the link above no longer works \(exit code 1\): "
                                        "worker died"):
        ui.serve("ui-exp", "127.0.0.1", port)
    assert f"http://127.0.0.1:{port}/#/experiments/" in capsys.readouterr().out


def test_the_server_runs_without_mlflows_job_runner_unless_the_user_asks(monkeypatch):
    monkeypatch.delenv(ui.JOB_EXECUTION, raising=False)
    monkeypatch.setenv("ONEGPU_UI_TEST", "kept")
    env = ui.server_env()
    assert env[ui.JOB_EXECUTION] == "false" and env["ONEGPU_UI_TEST"] == "kept"
    monkeypatch.setenv(ui.JOB_EXECUTION, "true")
    assert ui.server_env()[ui.JOB_EXECUTION] == "true"
    # Another environment as the base (a test's server): the same rule over that mapping only.
    assert ui.server_env({"PATH": "/x"}) == {"PATH": "/x", ui.JOB_EXECUTION: "false"}
    assert ui.server_env({ui.JOB_EXECUTION: "true"}) == {ui.JOB_EXECUTION: "true"}
