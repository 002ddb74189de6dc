"""``onegpu ui``: the MLflow UI on the project's store, bound to 127.0.0.1 by default.

MLflow 3's UI opens an experiment on a GenAI traces overview; the address printed here goes straight
to the training-runs table, in MLflow's model-training view, with the columns people compare. It uses
only what MLflow's UI (3.x) itself reads:

- the experiment tag ``mlflow.experimentKind = custom_model_development`` ("Machine learning"), and the
  URL parameter ``workflowType=machine_learning``, which the UI prefers to the tag when its GenAI /
  Model-training switch is shown;
- a saved view: the experiment tag ``mlflow.sharedViewState.<key>`` holds a JSON view state (search
  filter, order, selected columns) that the UI applies when the URL carries ``viewStateShareKey=<key>``
  (MLflow's own "Share" button writes the same tag).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from urllib.parse import urlencode

from onegpu import paths, tracking
from onegpu.equivalence.key import (KEY_TAG, RESOLVED_ACCUMULATION, RESOLVED_EFFECTIVE_BATCH,
                                    RESOLVED_MICRO_BATCH)
from onegpu.errors import UserError

VIEW_KEY = "onegpu-training-runs"  # the saved view's key: tag mlflow.sharedViewState.<VIEW_KEY>
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")
# Columns of the runs table, in this order (those no training run has are left out).
VIEW_METRICS = ("loss", "eval_loss", "eval_accuracy", "eval_f1_macro", "eval_perplexity",
                "train_mem_peak_bytes", "train_samples_per_second", "train_runtime")
VIEW_PARAMS = (RESOLVED_MICRO_BATCH, RESOLVED_ACCUMULATION, RESOLVED_EFFECTIVE_BATCH,
               "train.gradient_checkpointing", "train.backend")
VIEW_TAGS = (KEY_TAG,)
TRAINING_FILTER = "tags.stage = 'train'"


def _column(kind: str, key: str) -> str:
    """MLflow UI's column id: ``<attributes|params|metrics|tags>.`<key>```."""
    return f"{kind}.`{key}`"


def training_view(metric_keys: set[str] | None = None) -> dict:
    """The runs-table view state that ``onegpu ui`` saves: training runs only (``tags.stage = 'train'``:
    no prepare or comparison runs), newest first, columns :data:`VIEW_METRICS` (those in
    ``metric_keys``, all when None), :data:`VIEW_PARAMS` and :data:`VIEW_TAGS`.

    The keys are those of MLflow UI's search facets and UI state (``searchFilter``, ``orderByKey``,
    ``orderByAsc``, ``selectedColumns``, ...), as its "Share" button stores them.
    """
    metrics = [m for m in VIEW_METRICS if metric_keys is None or m in metric_keys]
    return {"searchFilter": TRAINING_FILTER, "orderByKey": "attributes.start_time", "orderByAsc": False,
            "startTime": "ALL", "lifecycleFilter": "Active",
            "selectedColumns": [*(_column("metrics", m) for m in metrics),
                                *(_column("params", p) for p in VIEW_PARAMS),
                                *(_column("tags", t) for t in VIEW_TAGS)],
            "runsHiddenMode": "SHOW_ALL"}


def present(tracker: "tracking.Tracker", base: str) -> str:
    """Mark the experiment as model training, save :func:`training_view` on it (experiment tags) and
    return the link to its runs table in that view: ``<base>/#/experiments/<id>/runs?workflowType=
    machine_learning&viewStateShareKey=onegpu-training-runs``."""
    client = tracker.client
    keys: set[str] = set()
    for run in client.search_runs([tracker.experiment_id], filter_string=TRAINING_FILTER, max_results=50):
        keys.update(run.data.metrics)
    client.set_experiment_tag(tracker.experiment_id, *EXPERIMENT_KIND)
    client.set_experiment_tag(tracker.experiment_id, f"mlflow.sharedViewState.{VIEW_KEY}",
                              json.dumps(training_view(keys or None)))
    query = urlencode({"workflowType": "machine_learning", "viewStateShareKey": VIEW_KEY})
    return f"{tracker.runs_table_url(base)}?{query}"


def serve(experiment_name: str, host: str = "127.0.0.1", port: int = 5000) -> int:
    """Run ``mlflow server`` (one worker) in the foreground until Ctrl-C; print the runs-table link.

    Returns the server's exit code (0 after Ctrl-C).
    Raises:
        UserError: the store cannot be opened, or mlflow's command is missing.
    """
    tracker = tracking.connect(experiment_name)
    if not tracker.uri.startswith("sqlite:") and not tracker.uri.startswith("file:"):
        print(f"MLFLOW_TRACKING_URI is a server ({tracking.redact(tracker.uri)}): open it directly at "
              f"{present(tracker, tracker.uri)}")
        return 0
    exe = shutil.which("mlflow", path=os.path.dirname(sys.executable)) or shutil.which("mlflow")
    if exe is None:
        raise UserError("the mlflow command is not installed in this environment (make install)")
    cmd = [exe, "server", "--backend-store-uri", tracker.uri, "--host", host, "--port", str(port),
           "--workers", "1", "--default-artifact-root", paths.artifact_root().as_uri()]
    # Its own session: Ctrl-C and SIGTERM reach only onegpu, which stops the whole server group
    # (mlflow's CLI, uvicorn) quietly; nothing keeps serving the port after onegpu exits.
    base = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
    link = present(tracker, base)
    proc = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    previous = signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
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
              f"  {link}\nCtrl-C stops it.", flush=True)
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
