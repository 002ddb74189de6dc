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

import collections
import contextlib
import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Mapping
from urllib.parse import urlencode, urlparse

from onegpu import paths, tracking
from onegpu.errors import UserError

VIEW_KEY = "onegpu-training-runs"  # the saved view's key: tag mlflow.sharedViewState.<VIEW_KEY>
EXPERIMENT_KIND = tracking.EXPERIMENT_KIND  # set on a new experiment too (tracking.store); here for older ones
# Columns of the runs table, in this order (metrics no training run has are left out). Memory and speed
# come as the train stage's tags in people's units (training.record.run_tags.TABLE_TAGS: "1.46 GiB",
# "2.53 samples/s", "71% of 2 CPUs"): MLflow prints the metrics raw (1572425728, nine-digit floats).
# The split and the knobs that are on are in the tag config ("bs4x4-fp32-ckpt"; with `auto`, the split
# it chose): one column instead of the five params of the split, checkpointing and backend, so the costs
# fit beside MLflow's Assistant panel, which opens by itself on a local server's first visit.
VIEW_METRICS = ("loss", "eval_loss", "test_loss", "test_accuracy", "test_f1_macro", "test_perplexity")
VIEW_PARAMS = ()
VIEW_TAGS = ("config", "memory", "outside_load", "speed")  # the UI orders them by name
# MLflow's own columns (ATTRIBUTE_COLUMN_LABELS): the datasets a run read (name and digest) and its logged model.
VIEW_ATTRIBUTES = ("Dataset", "Models")
TRAINING_FILTER = "tags.stage = 'train'"


def _column(kind: str, key: str) -> str:
    """MLflow UI's column id: ``<attributes|params|metrics|tags>.`<key>```."""
    return f"{kind}.`{key}`"


def training_view(metric_keys: set[str] | None = None) -> dict:
    """The runs-table view state that ``onegpu ui`` saves: training runs only (``tags.stage = 'train'``:
    no prepare or comparison runs), newest first, columns :data:`VIEW_ATTRIBUTES`, :data:`VIEW_METRICS`
    (those in ``metric_keys``, all when None), :data:`VIEW_PARAMS` and :data:`VIEW_TAGS`.

    The keys are those of MLflow UI's search facets and UI state (``searchFilter``, ``orderByKey``,
    ``orderByAsc``, ``selectedColumns``, ...), as its "Share" button stores them.
    """
    metrics = [m for m in VIEW_METRICS if metric_keys is None or m in metric_keys]
    return {"searchFilter": TRAINING_FILTER, "orderByKey": "attributes.start_time", "orderByAsc": False,
            "startTime": "ALL", "lifecycleFilter": "Active",
            "selectedColumns": [*(_column("attributes", a) for a in VIEW_ATTRIBUTES),
                                *(_column("metrics", m) for m in metrics),
                                *(_column("params", p) for p in VIEW_PARAMS),
                                *(_column("tags", t) for t in VIEW_TAGS)],
            "runsHiddenMode": "SHOW_ALL"}


def present(tracker: tracking.Tracker, base: str) -> str:
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


def latest_run_link(tracker: tracking.Tracker, base: str) -> str | None:
    """The page of the newest training run in the model-training view (``<runs table>/<run id>?workflowType=
    machine_learning``: MLflow's UI otherwise opens a run page in its GenAI view on a first visit), with
    the run's name; None when the experiment has no training run."""
    runs = tracker.client.search_runs([tracker.experiment_id], filter_string=TRAINING_FILTER, max_results=1,
                                      order_by=["attributes.start_time DESC"])
    if not runs:
        return None
    url = f"{tracker.runs_table_url(base)}/{runs[0].info.run_id}?workflowType=machine_learning"
    return f"{runs[0].info.run_name}: {url}"


# Seconds the MLflow server may take to answer its /health address (a busy small machine's time:
# bench/results/measured_notes.md).
START_TIMEOUT_S = 120.0


def _check_port(host: str, port: int) -> None:
    """Fail at once, before any work, when ``host:port`` cannot be served (another program listens
    there, the address is not this machine's, or the host name is unknown).

    Raises:
        UserError: naming the address and the ``--port`` / ``--host`` option.
    """
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError) as e:
        raise UserError(f"--host {host}: not an address of this machine ({e}); the default is 127.0.0.1") from None
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds: TIME_WAIT is no conflict
        try:
            s.bind(address)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise UserError(f"port {port} on {host} is in use by another program: choose another "
                                f"with --port (e.g. onegpu ui --port {_free_port(host, port)})") from None
            raise UserError(f"cannot serve on {host}:{port} ({e.strerror}): choose another --host or "
                            "--port") from None


def _free_port(host: str, after: int) -> int:
    """The first port above ``after`` that ``host`` can bind (for the message), else ``after + 1``."""
    for port in range(after + 1, min(after + 50, 65536)):
        with socket.socket() as s, contextlib.suppress(OSError):
            s.bind((host, port))
            return port
    return after + 1


def _server_command(uri: str, host: str, port: int) -> list[str]:
    """``mlflow server`` with one worker on ``uri``.

    Raises:
        UserError: mlflow's command is missing.
    """
    exe = shutil.which("mlflow", path=os.path.dirname(sys.executable)) or shutil.which("mlflow")
    if exe is None:
        raise UserError("the mlflow command is not installed in this environment (make install)")
    return [exe, "server", "--backend-store-uri", uri, "--host", host, "--port", str(port),
            "--workers", "1", "--default-artifact-root", paths.artifact_root().as_uri()]


# MLflow 3's server-side job runner (GenAI jobs: prompt optimisation, scorers) starts a runner and seven
# huey consumer processes beside the UI (what they cost: bench/results/measured_notes.md); nothing
# onegpu logs uses it. A value the user set is kept.
JOB_EXECUTION = "MLFLOW_SERVER_ENABLE_JOB_EXECUTION"


def server_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """An ``mlflow server``'s environment: ``base`` (None: this process's), with MLflow's job execution
    off unless ``base`` sets it."""
    return {JOB_EXECUTION: "false", **(os.environ if base is None else base)}


class _Log:
    """The server's stderr, drained by a thread (a full pipe would block the server); the last lines
    kept for a failure message."""

    def __init__(self, proc: subprocess.Popen):
        self.lines: collections.deque = collections.deque(maxlen=20)
        self._reader = threading.Thread(target=lambda: self.lines.extend(x.rstrip() for x in proc.stderr),
                                        daemon=True)
        self._reader.start()

    def last(self) -> str | None:
        """The last line written so far."""
        return self.lines[-1] if self.lines else None

    def finish(self) -> None:
        """Wait (up to 2 s) for the lines of a server that exited."""
        self._reader.join(timeout=2)


def _stopped(proc: subprocess.Popen, log: _Log, when: str) -> UserError:
    """The error for a server that exited (``proc`` has ended), quoting its last log line."""
    proc.wait()
    log.finish()
    last = f": {log.last()}" if log.last() else ""
    return UserError(f"the MLflow server stopped {when} (exit code {proc.returncode}){last}")


def _wait_until_serving(proc: subprocess.Popen, base: str, log: _Log, timeout_s: float) -> None:
    """Return once ``<base>/health`` answers while ``proc`` still runs.

    Raises:
        UserError: the server exited first (its last log line quoted), or no answer in ``timeout_s`` s.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise _stopped(proc, log, "before it served")
        try:
            with urllib.request.urlopen(base + "/health", timeout=1) as r:
                if r.status == 200 and proc.poll() is None:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise UserError(f"the MLflow server did not answer on {base} within {timeout_s:.0f} s"
                    + (f" (its last log line: {log.last()})" if log.last() else "") + "; it was stopped")


def models_link(tracker, base: str) -> str:
    """The experiment's Models tab (every trained model with its eval metrics), in the model-training view."""
    return f"{base}/#/experiments/{tracker.experiment_id}/models?workflowType=machine_learning"


def serve(experiment_name: str, host: str = "127.0.0.1", port: int = 5000) -> int:
    """Run ``mlflow server`` (one worker) in the foreground until Ctrl-C; print the runs-table link
    once the server answers, and only then.

    Returns 0 after Ctrl-C or SIGTERM.
    Raises:
        UserError: the port is taken or the host is not this machine's (before any work), the store
            cannot be opened, mlflow's command is missing, or the server stopped or never answered
            (before the link; or later, on its own).
    """
    if urlparse(paths.tracking_uri()).scheme not in ("http", "https"):
        _check_port(host, port)
    tracker = tracking.connect(experiment_name)
    if not tracker.uri.startswith("sqlite:") and not tracker.uri.startswith("file:"):
        print(f"MLFLOW_TRACKING_URI is a server ({tracking.redact(tracker.uri)}): open it directly at "
              f"{present(tracker, tracker.uri)}")
        return 0
    cmd = _server_command(tracker.uri, host, port)
    base = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
    link = present(tracker, base)
    latest = latest_run_link(tracker, base)
    # Its own session: Ctrl-C and SIGTERM reach only onegpu, which stops the whole server group
    # (mlflow's CLI, uvicorn) quietly; nothing keeps serving the port after onegpu exits.
    proc = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env=server_env())
    log = _Log(proc)
    previous = signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        _wait_until_serving(proc, base, log, START_TIMEOUT_S)
        print(f"MLflow UI for experiment {experiment_name!r} (store {tracking.redact(tracker.uri)}):\n"
              f"  {link}\n" + (f"  the latest training run, {latest}\n" if latest else "")
              + f"  the trained models (MLflow's Models tab): {models_link(tracker, base)}\nCtrl-C stops it.",
              flush=True)
        proc.wait()
        raise _stopped(proc, log, "on its own; the link above no longer works")
    except KeyboardInterrupt:
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous)
        _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
    """Stop the server's process group (SIGTERM, then SIGKILL after 15 s)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=15)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
