"""``onegpu ui``: the MLflow UI on the project's store, bound to 127.0.0.1 by default.

MLflow 3's UI opens an experiment on a GenAI traces overview; the address printed here goes straight
to the training-runs table (``#/experiments/<id>/runs``).
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

from onegpu import paths, tracking
from onegpu.errors import UserError


def serve(experiment_name: str, host: str = "127.0.0.1", port: int = 5000) -> int:
    """Run ``mlflow server`` (one worker) in the foreground until Ctrl-C; print the runs-table link.

    Returns the server's exit code (0 after Ctrl-C).
    Raises:
        UserError: the store cannot be opened, or mlflow's command is missing.
    """
    tracker = tracking.connect(experiment_name)
    if not tracker.uri.startswith("sqlite:") and not tracker.uri.startswith("file:"):
        print(f"MLFLOW_TRACKING_URI is a server ({tracking.redact(tracker.uri)}): open it directly at "
              f"{tracker.runs_table_url(tracker.uri)}")
        return 0
    exe = shutil.which("mlflow", path=os.path.dirname(sys.executable)) or shutil.which("mlflow")
    if exe is None:
        raise UserError("the mlflow command is not installed in this environment (make install)")
    cmd = [exe, "server", "--backend-store-uri", tracker.uri, "--host", host, "--port", str(port),
           "--workers", "1", "--default-artifact-root", paths.artifact_root().as_uri()]
    # Its own session: Ctrl-C and SIGTERM reach only onegpu, which stops the whole server group
    # (mlflow's CLI, uvicorn) quietly; nothing keeps serving the port after onegpu exits.
    proc = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    previous = signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    base = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
    try:
        for _ in range(240):
            if proc.poll() is not None:
                err = (proc.stderr.read() or "").strip().splitlines()
                raise UserError(f"mlflow server exited with code {proc.returncode} (is port {port} in use? "
                                f"try --port){': ' + err[-1] if err else ''}")
            try:
                urllib.request.urlopen(base + "/health", timeout=1)
                break
            except OSError:
                time.sleep(0.5)
        print(f"MLflow UI for experiment {experiment_name!r} (store {tracking.redact(tracker.uri)}):\n"
              f"  {tracker.runs_table_url(base)}\nCtrl-C stops it.", flush=True)
        while proc.poll() is None:  # drain the server's log so it never blocks on a full pipe
            proc.stderr.readline()
        return proc.returncode
    except KeyboardInterrupt:
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous)
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=15)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                os.killpg(proc.pid, signal.SIGKILL)
