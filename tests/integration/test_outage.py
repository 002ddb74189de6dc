"""A real `mlflow server` on 127.0.0.1: unreachable at start fails fast; going away mid-run does not stop
training, and `onegpu sync` writes every spooled step once the server is back. (The data is ``prepared``'s:
`onegpu prepare` against an unreachable server is test_bad_inputs.py's; here it is `onegpu train`.)"""
from __future__ import annotations

import signal
import socket
import subprocess
import time
import urllib.request

import pytest

from onegpu import ui

from .conftest import BIN, _env

pytestmark = pytest.mark.slow
STEPS = 12


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server(db, port):
    p = subprocess.Popen([str(BIN / "mlflow"), "server", "--backend-store-uri", f"sqlite:///{db}", "--host",
                          "127.0.0.1", "--port", str(port), "--workers", "1"],
                         env=ui.server_env(_env()),  # as onegpu ui runs it: MLflow's GenAI job runner off
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    for _ in range(240):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            return p
        except OSError:
            if p.poll() is not None:
                raise AssertionError("mlflow server exited") from None
            time.sleep(0.5)
    p.kill()
    raise AssertionError("mlflow server did not start")


def _stop(p):
    import os
    os.killpg(p.pid, signal.SIGTERM)
    p.wait(timeout=30)


def test_unreachable_server_fails_fast_and_an_outage_mid_run_loses_nothing(tmp_path, prepared):
    project = prepared(tmp_path / "p", {"train": {"max_steps": STEPS, "logging_steps": 1,
                                                  "per_device_train_batch_size": 2,
                                                  "gradient_accumulation_steps": 1}})
    port = _free_port()
    uri = f"http://127.0.0.1:{port}"
    env = {**_env(), "MLFLOW_TRACKING_URI": uri, "PYTHONUNBUFFERED": "1"}
    onegpu = str(BIN / "onegpu")

    start = time.monotonic()
    p = subprocess.run([onegpu, "train"], cwd=project, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "cannot be reached" in p.stderr, p.stderr
    # Fast: one TCP connection's refusal, not MLflow's own retries (its defaults: 7 with backoff factor 2, over 4
    # minutes); the rest is the process's start-up (10 s on an idle 2-core machine, 15 s seen under the suite's load).
    assert time.monotonic() - start < 60
    assert not (project / "models").exists() and not (project / ".onegpu" / "spool").exists()

    server = _server(tmp_path / "store.db", port)
    try:
        train = subprocess.Popen([onegpu, "train"], cwd=project, env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True)
        lines = []
        for line in train.stdout:
            lines.append(line)
            if " | loss " in line:  # the run exists on the server and training is under way
                _stop(server)
                server = None
                break
        lines.append(train.stdout.read())
        assert train.wait(timeout=600) == 0, "".join(lines)  # the outage did not stop training
        out = "".join(lines)
        assert "unreachable" in out and "onegpu sync" in out, out
        spooled = list((project / ".onegpu" / "spool").glob("*.jsonl"))
        assert len(spooled) == 1
        run_id = spooled[0].stem

        p = subprocess.run([onegpu, "sync"], cwd=project, env=env, capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and "still unreachable" in p.stderr  # nothing is dropped while it is down
        assert spooled[0].is_file()

        server = _server(tmp_path / "store.db", port)
        p = subprocess.run([onegpu, "sync"], cwd=project, env=env, capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr
        assert not spooled[0].exists()
        from mlflow import MlflowClient
        c = MlflowClient(tracking_uri=uri)
        for key in ("loss", "grad_norm", "step_time_s", "mem_peak_bytes"):
            assert sorted(m.step for m in c.get_metric_history(run_id, key)) == list(range(1, STEPS + 1)), key
        m = c.get_run(run_id).data.metrics
        assert m["train_runtime"] > 0 and "mem_params_bytes" in m
    finally:
        if server is not None:
            _stop(server)
