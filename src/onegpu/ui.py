"""``onegpu ui``: the MLflow UI on the project's store, bound to 127.0.0.1 by default.

MLflow 3's UI opens an experiment on a GenAI traces overview; the address printed here goes straight
to the training-runs table (``#/experiments/<id>/runs``).
"""
from __future__ import annotations

import os
import shutil
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
    proc = subprocess.Popen(cmd)
    base = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
    try:
        for _ in range(120):
            if proc.poll() is not None:
                raise UserError(f"mlflow server exited with code {proc.returncode} (is port {port} in use? "
                                "try --port)")
            try:
                urllib.request.urlopen(base + "/health", timeout=1)
                break
            except OSError:
                time.sleep(0.5)
        print(f"\nMLflow UI for experiment {experiment_name!r} (store {tracking.redact(tracker.uri)}):\n"
              f"  {tracker.runs_table_url(base)}\nCtrl-C stops it.", flush=True)
        return proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        proc.wait(timeout=10)
        return 0
