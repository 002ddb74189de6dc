"""Everything MLflow: the store, the experiment, runs, params and tags, batched metrics, artifacts.

The only module that imports mlflow. It uses ``MlflowClient`` with explicit run ids (no global
"active run").

Run lifecycle: a run is RUNNING only while a process writes to it. Train creates the run and ends it
(FINISHED, or FAILED/KILLED) when the stage ends; evaluate re-opens the same run id
(:meth:`Tracker.resume_run`) and ends it again. Every run records its writer (tags
``onegpu.writer.host``, ``onegpu.writer.pid``, ``onegpu.writer.started``); whenever a stage opens a run,
RUNNING runs of the experiment whose writer process is gone from this host (SIGKILL, the OOM killer, a
power loss) are marked KILLED with the tag ``onegpu.killed_reason`` (:meth:`Tracker.reap_orphans`).

Store and experiment creation are serialised with a file lock in the project root: several processes
opening a *fresh* SQLite store at once crash creating its schema, and several setting a *new* experiment
at once can silently log into experiment 0 (measured here, see ../shared/design.md).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from onegpu import paths
from onegpu.errors import UserError

# MLflow limits (mlflow/utils/validation.py): param values are at most 6000 characters.
_MAX_PARAM_LEN = 6000

# Who writes to a run (set when a stage opens it): a RUNNING run whose writer is gone is an orphan.
WRITER_HOST, WRITER_PID, WRITER_STARTED = "onegpu.writer.host", "onegpu.writer.pid", "onegpu.writer.started"
KILLED_REASON = "onegpu.killed_reason"
# Tag on a run whose param value was cut at MLflow's limit: the keys, comma-separated.
TRUNCATED_PARAMS = "onegpu.truncated_params"


def writer_tags() -> dict[str, str]:
    """This process as a run's writer: host name, pid and the process's start time (s since the epoch,
    from psutil; it tells a reused pid from the writer)."""
    import socket

    import psutil
    me = psutil.Process()
    return {WRITER_HOST: socket.gethostname(), WRITER_PID: str(me.pid), WRITER_STARTED: f"{me.create_time():.2f}"}


def writer_gone(tags: dict[str, str]) -> str | None:
    """Why the writer named in a run's ``tags`` is gone, or None when it may still be writing (it lives,
    it is on another host, or the run names no writer: a run from another tool is never judged)."""
    import socket

    import psutil
    host, pid = tags.get(WRITER_HOST), tags.get(WRITER_PID)
    if not host or not pid or host != socket.gethostname():
        return None
    try:
        proc = psutil.Process(int(pid))
        started = proc.create_time()
    except psutil.NoSuchProcess:
        return f"its writer, process {pid} on {host}, is gone"
    except (psutil.Error, ValueError):
        return None
    try:
        if abs(started - float(tags.get(WRITER_STARTED, started))) > 1.0:
            return f"its writer, process {pid} on {host}, is gone (the pid now belongs to another process)"
    except ValueError:
        return None
    return None


def _check_uri(uri: str) -> None:
    scheme = urlparse(uri).scheme
    if scheme not in ("sqlite", "http", "https", "file", "postgresql", "mysql", "databricks", ""):
        raise UserError(f"MLFLOW_TRACKING_URI={redact(uri)!r} has an unsupported scheme {scheme!r}; "
                        "use sqlite:///ABSOLUTE/PATH.db, http(s)://HOST:PORT or leave it unset for "
                        "<project root>/mlflow.db")
    if scheme == "sqlite" and not uri.startswith("sqlite:///"):
        raise UserError(f"MLFLOW_TRACKING_URI={uri!r}: a SQLite URI is sqlite:///ABSOLUTE/PATH.db")


def redact(uri: str) -> str:
    """``uri`` with any password replaced by ``***`` (never log credentials)."""
    p = urlparse(uri)
    if p.password:
        return uri.replace(f":{p.password}@", ":***@")
    return uri


@dataclass
class Tracker:
    """A connection to the project's store and experiment.

    ``spool_dir``: where writes that cannot reach the store wait (``<root>/.onegpu/spool``); None
    writes straight through and raises on failure.
    """
    client: Any
    experiment_id: str
    uri: str
    spool_dir: Path | None = None
    _warned: bool = False

    # -- runs ---------------------------------------------------------------------------------
    def start_run(self, run_name: str | None, tags: dict[str, str]) -> str:
        """Create a run (status RUNNING, this process as its writer) and return its id. Orphans of the
        experiment are reaped first (:meth:`reap_orphans`)."""
        self.reap_orphans()
        run = self.client.create_run(self.experiment_id, run_name=run_name, tags={**tags, **writer_tags()})
        return run.info.run_id

    def resume_run(self, run_id: str) -> None:
        """Re-open an ended run (status RUNNING again, this process as its writer) to log more into it;
        end it again with :meth:`end_run` or :meth:`guard`. MLflow allows logging to a terminated run;
        this only makes its status tell the truth while a process writes. Orphans are reaped first.

        Raises:
            UserError: the run does not exist in this store, or is deleted.
        """
        self.reap_orphans()
        try:
            run = self.client.get_run(run_id)
        except Exception as e:
            if _is_outage(e):
                raise
            raise UserError(f"MLflow run {run_id} is not in {redact(self.uri)}; train again "
                            "(`dvc repro -f train`)") from None
        if run.info.lifecycle_stage == "deleted":
            raise UserError(f"MLflow run {run_id} is deleted in {redact(self.uri)}; restore it "
                            f"(MLFLOW_TRACKING_URI={redact(self.uri)} mlflow runs restore --run-id {run_id}) "
                            "or train again (`dvc repro -f train`)")
        self.set_tags(run_id, writer_tags())  # before the status: a reaper must never see a dead writer
        self._write(run_id, "reopen", ["RUNNING"])

    def reap_orphans(self) -> list[str]:
        """Mark KILLED every RUNNING run of this experiment whose writer process is gone from this host
        (tag ``onegpu.killed_reason`` says why); return their ids. Runs on other hosts, runs without
        writer tags and live writers are left alone; a store that cannot be searched is skipped."""
        try:
            runs = self.client.search_runs([self.experiment_id], filter_string="attributes.status = 'RUNNING'",
                                           max_results=1000)
        except Exception:
            return []
        reaped = []
        for run in runs:
            why = writer_gone(run.data.tags)
            if why is None:
                continue
            try:
                self.client.set_tag(run.info.run_id, KILLED_REASON, f"left RUNNING: {why}")
                self.client.set_terminated(run.info.run_id, status="KILLED")
            except Exception:
                continue
            reaped.append(run.info.run_id)
            print(f"onegpu: MLflow run {run.info.run_name or ''} {run.info.run_id} was left RUNNING and {why}; "
                  "marked KILLED", file=sys.stderr, flush=True)
        return reaped

    def end_run(self, run_id: str, status: str = "FINISHED") -> None:
        """End the run with ``status``: FINISHED, FAILED, KILLED, or SCHEDULED (trained, not yet evaluated)."""
        self._write(run_id, "status", [status])

    @contextmanager
    def guard(self, run_id: str, finish: bool | str = True, context=None):
        """End ``run_id`` FAILED (KILLED on Ctrl-C or SIGTERM) with the error as tags if the block raises;
        if it returns, FINISHED when ``finish`` is true, or the status ``finish`` names (train ends its run
        SCHEDULED: trained, its evaluate stage still to come). A run that ``finish=False`` leaves RUNNING
        must be ended by the same process: no run stays RUNNING without a writer.
        ``context``: a callable returning more tags for the error (e.g. ``error.step``)."""
        try:
            yield
        except BaseException as e:
            killed = isinstance(e, KeyboardInterrupt)
            try:
                extra = context() if context else {}
                if getattr(e, "step", None) is not None:  # the error knows its optimizer step
                    extra["error.step"] = str(e.step)
                self.set_tags(run_id, {"error.type": type(e).__name__, "error.message": str(e)[:5000], **extra})
                self.end_run(run_id, "KILLED" if killed else "FAILED")
            except Exception:
                pass  # the store itself failed: the original error is what the user needs
            raise
        else:
            if finish:
                self.end_run(run_id, finish if isinstance(finish, str) else "FINISHED")

    def find_run(self, run_id: str):
        """The MLflow run ``run_id`` (deleted ones too), or None when the store does not have it or
        cannot be read."""
        try:
            return self.client.get_run(run_id)
        except Exception:
            return None

    def run_status(self, run_id: str) -> str | None:
        try:
            return self.client.get_run(run_id).info.status
        except Exception:
            return None

    # -- params, tags, metrics ----------------------------------------------------------------
    def log_params(self, run_id: str, params: dict[str, Any]) -> None:
        """Log params (values as strings, ``None`` as ``'None'``) in batches.

        A value longer than MLflow's limit (6,000 characters) is cut to it, and the run gets the tag
        ``onegpu.truncated_params`` naming the cut keys (comma-separated) with their full lengths."""
        items = [[k, str(v)[:_MAX_PARAM_LEN]] for k, v in params.items()]
        cut = {k: len(str(v)) for k, v in params.items() if len(str(v)) > _MAX_PARAM_LEN}
        for i in range(0, len(items), 100):
            self._write(run_id, "params", items[i:i + 100])
        if cut:
            self.set_tags(run_id, {TRUNCATED_PARAMS: ", ".join(
                f"{k} ({n} characters, cut to {_MAX_PARAM_LEN})" for k, n in cut.items())[:5000]})

    def set_tags(self, run_id: str, tags: dict[str, str]) -> None:
        items = [[k, str(v)] for k, v in tags.items()]
        for i in range(0, len(items), 100):
            self._write(run_id, "tags", items[i:i + 100])

    def log_metrics(self, run_id: str, metrics: dict[str, float], step: int = 0) -> None:
        """Log several scalar metrics at one ``step`` in one batch."""
        ts = int(time.time() * 1000)
        items = [[k, float(v), ts, step] for k, v in metrics.items() if v is not None]
        for i in range(0, len(items), 1000):
            self._write(run_id, "metrics", items[i:i + 1000])

    # -- writes that survive an outage --------------------------------------------------------
    def _write(self, run_id: str, kind: str, items: list) -> None:
        """One batched write (``kind``: metrics, params, tags, status or reopen). If the store cannot take it,
        it is appended to this run's spool file instead and training goes on; the spool is replayed,
        in order, before the next write and by ``onegpu sync``."""
        if self.spool_dir is None:
            _apply(self.client, run_id, kind, items)
            return
        spool = Spool(self.spool_dir, run_id)
        try:
            if spool.pending():
                spool.replay(self.client)
            _apply(self.client, run_id, kind, items)
        except Exception as e:
            if not _is_outage(e):
                raise
            spool.append(kind, items)
            if not self._warned:
                self._warned = True
                print(f"onegpu: the MLflow store {redact(self.uri)} is unreachable ({type(e).__name__}); "
                      f"spooling to {spool.path}; later writes retry it, `onegpu sync` writes the rest",
                      file=sys.stderr, flush=True)

    def metric_buffer(self, run_id: str, flush_every: int = 200, flush_seconds: float = 30.0) -> "MetricBuffer":
        return MetricBuffer(self, run_id, flush_every=flush_every, flush_seconds=flush_seconds)

    # -- artifacts and inputs -----------------------------------------------------------------
    def log_artifact(self, run_id: str, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        self.client.log_artifact(run_id, str(path), artifact_path)

    def log_dict(self, run_id: str, obj: dict, artifact_file: str) -> None:
        self.client.log_dict(run_id, obj, artifact_file)

    def log_text(self, run_id: str, text: str, artifact_file: str) -> None:
        self.client.log_text(run_id, text, artifact_file)

    @contextmanager
    def system_metrics(self, run_id: str, interval_s: float = 5.0, resume: bool = False):
        """MLflow's system-metrics monitor (CPU, memory, disk, network; GPU utilisation and power via
        NVML where a GPU is) logging into ``run_id`` every ``interval_s`` seconds while the block runs.

        Its figures are machine-wide (MLflow's design); the process's own memory is in ``mem_*``.
        A monitor that cannot start is skipped: it never stops training.
        """
        import logging
        logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)  # start/stop chatter
        monitor = None
        try:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor
            monitor = SystemMetricsMonitor(run_id, sampling_interval=interval_s, samples_before_logging=1,
                                           resume_logging=resume, tracking_uri=self.uri)
            monitor.start()
        except Exception:
            monitor = None
        try:
            yield
        finally:
            if monitor is not None:
                monitor.finish()

    def log_figure(self, run_id: str, figure, artifact_file: str) -> None:
        self.client.log_figure(run_id, figure, artifact_file)

    def log_dataset(self, run_id: str, df, name: str, source: str, context: str, targets: str | None = None) -> None:
        """Record a pandas DataFrame as an MLflow dataset input (schema, digest, source) of the run."""
        import warnings

        import mlflow.data
        from mlflow.entities import DatasetInput, InputTag
        with warnings.catch_warnings():  # "source can be interpreted in multiple ways": both are local
            warnings.simplefilter("ignore", UserWarning)
            ds = mlflow.data.from_pandas(df, source=source, name=name, targets=targets)
        self.client.log_inputs(run_id, [DatasetInput(ds._to_mlflow_entity(),
                                                     [InputTag("mlflow.data.context", context)])])

    def runs_table_url(self, base: str) -> str:
        """The UI address of this experiment's training-runs table (not MLflow 3's GenAI overview)."""
        return f"{base.rstrip('/')}/#/experiments/{self.experiment_id}/runs"


class MetricBuffer:
    """Collects per-step metrics and writes them with one ``log_batch`` per ``flush_every`` records.

    One synchronous ``log_metric`` per value costs ~3.5 ms on SQLite; a batch of 1,000 about 70 ms in
    all (measured here, ../shared/design.md), so the training loop never waits on the store per step.
    """

    def __init__(self, tracker: Tracker, run_id: str, flush_every: int = 200, flush_seconds: float = 30.0):
        self.tracker, self.run_id = tracker, run_id
        self.flush_every, self.flush_seconds = flush_every, flush_seconds
        self._items: list = []
        self._last = time.monotonic()
        self.logged = 0

    def add(self, metrics: dict[str, float], step: int) -> None:
        ts = int(time.time() * 1000)
        self._items.extend([k, float(v), ts, step] for k, v in metrics.items() if v is not None)
        if len(self._items) >= self.flush_every or time.monotonic() - self._last > self.flush_seconds:
            self.flush()

    def flush(self) -> None:
        while self._items:
            chunk, self._items = self._items[:1000], self._items[1000:]
            self.tracker._write(self.run_id, "metrics", chunk)
            self.logged += len(chunk)
        self._last = time.monotonic()


def connect(experiment_name: str, root: Path | None = None) -> Tracker:
    """Open the project's store and get or create ``experiment_name``.

    Store: ``MLFLOW_TRACKING_URI`` if set, else ``sqlite:///<project root>/mlflow.db``; a new experiment
    on the default store keeps its artifacts in ``<project root>/mlartifacts`` (absolute, so a run from
    DVC's temp clone never points into a directory that is deleted).

    Raises:
        UserError: the URI is malformed, or the store cannot be opened.
    """
    import filelock
    from mlflow import MlflowClient

    root = root or paths.project_root()
    uri = paths.tracking_uri(root)
    _check_uri(uri)
    check_reachable(uri)
    if urlparse(uri).scheme in ("http", "https"):
        # MLflow's REST client retries for minutes by default; the spool takes over much sooner.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")
    default_store = paths.uses_default_store()
    import logging
    db_log = logging.getLogger("mlflow.store.db.utils")  # "Creating initial MLflow database tables..."
    old_level = db_log.level
    with filelock.FileLock(str(paths.lock_file(root)), timeout=120):
        try:
            db_log.setLevel(logging.WARNING)
            client = MlflowClient(tracking_uri=uri)
            exp = client.get_experiment_by_name(experiment_name)
            if exp is None:
                location = paths.artifact_root(root).as_uri() if default_store else None
                exp_id = client.create_experiment(experiment_name, artifact_location=location)
            else:
                if exp.lifecycle_stage == "deleted":
                    raise UserError(deleted_experiment_message(exp, uri, "choose another tracking.experiment_name"))
                exp_id = exp.experiment_id
        except UserError:
            raise
        except Exception as e:
            raise UserError(f"cannot open the MLflow store {redact(uri)}: {type(e).__name__}: {e}") from None
        finally:
            db_log.setLevel(old_level)
    return Tracker(client=client, experiment_id=exp_id, uri=uri, spool_dir=paths.spool_dir(root))


def deleted_experiment_message(exp, uri: str, alternative: str) -> str:
    """One message for a deleted experiment, the same from every command: its name and id, and how to
    restore it (``mlflow experiments restore``) or what else to do (``alternative``)."""
    return (f"MLflow experiment {exp.name!r} (id {exp.experiment_id}) is deleted in {redact(uri)}; restore it "
            f"(MLFLOW_TRACKING_URI={redact(uri)} mlflow experiments restore --experiment-id {exp.experiment_id}, "
            f"or in the UI) or {alternative}")


def git_commit(cwd: str | os.PathLike = ".") -> str:
    """The commit the run's code came from: DVC's experiment baseline, else ``git rev-parse HEAD``."""
    rev = os.environ.get("DVC_EXP_BASELINE_REV")
    if rev:
        return rev
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True,
                              timeout=10).stdout.strip() or "none"
    except (OSError, subprocess.SubprocessError):
        return "none"


def run_context_tags() -> dict[str, str]:
    """Tags every onegpu run carries: the git commit and, under ``dvc exp run``, the DVC names."""
    tags = {"mlflow.source.git.commit": git_commit(),
            "mlflow.source.type": "PROJECT", "mlflow.source.name": "onegpu"}
    if os.environ.get("DVC_EXP_NAME"):
        tags["dvc.exp_name"] = os.environ["DVC_EXP_NAME"]
    if os.environ.get("DVC_EXP_BASELINE_REV"):
        tags["dvc.baseline_rev"] = os.environ["DVC_EXP_BASELINE_REV"]
    if os.environ.get("DVC_STAGE"):
        tags["dvc.stage"] = os.environ["DVC_STAGE"]
    return tags


def run_name() -> str | None:
    """The DVC experiment name when there is one; else None (MLflow picks a name)."""
    return os.environ.get("DVC_EXP_NAME") or None


# -- compare: reading training runs back, and the comparison run ------------------------------------
# (used by ``onegpu compare``; the records are plain dicts, see onegpu.equivalence.RunRecord)

# Per-step metrics (MLflow step = optimizer step, from 1) fetched for a comparison.
STEP_SERIES = ("loss", "grad_norm", "learning_rate", "step_time_s", "samples_per_second", "mem_peak_bytes",
               "step_examples")


def open_existing(experiment_name: str, root: Path | None = None) -> Tracker:
    """Open the project's store and ``experiment_name`` for reading; create neither.

    Raises:
        UserError: the default store file does not exist yet, the experiment does not exist (the
            message lists the ones that do), or the store cannot be opened.
    """
    from mlflow import MlflowClient

    root = root or paths.project_root()
    uri = paths.tracking_uri(root)
    _check_uri(uri)
    check_reachable(uri)
    if paths.uses_default_store() and not (root / "mlflow.db").is_file():
        raise UserError(f"no MLflow store at {root / 'mlflow.db'}: no training runs yet. Train first "
                        "(`dvc repro` or `dvc exp run -S ...`), or set MLFLOW_TRACKING_URI")
    try:
        client = MlflowClient(tracking_uri=uri)
        exp = client.get_experiment_by_name(experiment_name)
        names = [] if exp is not None else [e.name for e in client.search_experiments()]
    except Exception as e:
        raise UserError(f"cannot open the MLflow store {redact(uri)}: {type(e).__name__}: {e}") from None
    if exp is not None and exp.lifecycle_stage == "deleted":
        raise UserError(deleted_experiment_message(exp, uri, "choose another with --experiment"))
    if exp is None:
        raise UserError(f"no MLflow experiment {experiment_name!r} in {redact(uri)}"
                        + (f"; experiments there: {', '.join(sorted(names))}" if names else "")
                        + " (choose one with --experiment)")
    return Tracker(client=client, experiment_id=exp.experiment_id, uri=uri)


def metric_histories(tracker: Tracker, run_id: str, keys: tuple[str, ...] = STEP_SERIES) -> dict[str, list[tuple[int, float]]]:
    """Full per-step histories of ``keys`` for one run: ``{key: [(step, value), ...]}`` sorted by step;
    when a step was logged twice the later value wins. Keys the run never logged are left out."""
    out: dict[str, list[tuple[int, float]]] = {}
    for key in keys:
        hist = tracker.client.get_metric_history(run_id, key)
        if not hist:
            continue
        by_step: dict[int, float] = {}
        for m in sorted(hist, key=lambda m: (m.step, m.timestamp)):
            by_step[int(m.step)] = float(m.value)
        out[key] = sorted(by_step.items())
    return out


def step_window(tracker: Tracker, run) -> tuple[int, int] | None:
    """A run's training window in ms since the epoch from its ``step_time_s`` history, for runs without
    the ``onegpu.train_start_ms``/``onegpu.train_end_ms`` tags: (first, last) step timestamp, i.e. the
    end of the first step to the end of the last (one step shorter than the real window, so it flags
    only clear overlaps). None when the tags exist or nothing was logged."""
    if run.data.tags.get("onegpu.train_start_ms"):
        return None
    hist = tracker.client.get_metric_history(run.info.run_id, "step_time_s")
    if not hist:
        return None
    return int(min(m.timestamp for m in hist)), int(max(m.timestamp for m in hist))


def _run_record(tracker: Tracker, run) -> dict:
    return {"run_id": run.info.run_id, "name": run.info.run_name or "",
            "params": dict(run.data.params), "tags": dict(run.data.tags),
            "metrics": dict(run.data.metrics), "series": metric_histories(tracker, run.info.run_id),
            "start_time": int(run.info.start_time or 0), "status": run.info.status,
            "window": step_window(tracker, run)}


def training_run_windows(tracker: Tracker) -> list[dict]:
    """Every training run of the experiment with its tags only (no histories): RunRecord fields
    ``run_id``, ``name``, ``tags``, ``start_time``, for overlap checks against runs outside a filter."""
    out, token = [], None
    while True:
        page = tracker.client.search_runs([tracker.experiment_id], filter_string="tags.stage = 'train'",
                                          max_results=1000, page_token=token)
        out += [{"run_id": r.info.run_id, "name": r.info.run_name or "", "tags": dict(r.data.tags),
                 "start_time": int(r.info.start_time or 0)} for r in page]
        token = page.token
        if not token:
            return out


def training_runs(tracker: Tracker, key: str | None = None, run_ids: list[str] | None = None,
                  exp_names: list[str] | None = None) -> list[dict]:
    """The training runs (tag ``stage=train``) of the tracker's experiment, with full per-step histories.

    Filters (all that are given apply):
        key: the ``equivalence_key`` tag, or a unique prefix of it.
        run_ids: these runs only (each must exist and be a training run; it may be in another experiment).
        exp_names: runs whose ``dvc.exp_name`` tag (or run name) is one of these DVC experiment names.
    Returns:
        Dicts with the fields of :class:`onegpu.equivalence.RunRecord` (run_id, name, params, tags,
        metrics = last values, series = per-step histories of :data:`STEP_SERIES`, start_time in ms,
        status), oldest first.
    Raises:
        UserError: a run id does not exist or is not a training run, a key prefix is ambiguous, or an
            experiment name matches no training run.
    """
    if run_ids:
        runs = []
        for rid in dict.fromkeys(run_ids):
            try:
                run = tracker.client.get_run(rid)
            except Exception:
                raise UserError(f"no MLflow run {rid!r} in {redact(tracker.uri)}") from None
            stage = run.data.tags.get("stage")
            if stage != "train":
                raise UserError(f"run {rid!r} is not a training run (tag stage={stage!r})")
            runs.append(run)
    else:
        runs, token = [], None
        while True:
            page = tracker.client.search_runs([tracker.experiment_id], filter_string="tags.stage = 'train'",
                                              max_results=1000, page_token=token)
            runs.extend(page)
            token = page.token
            if not token:
                break
    if key:
        keys = {r.data.tags.get("equivalence_key") for r in runs}
        matching = [key] if key in keys else sorted(k for k in keys if k and k.startswith(key))
        if len(matching) > 1:
            raise UserError(f"--key {key!r} matches several equivalence keys: {', '.join(matching)}")
        runs = [r for r in runs if r.data.tags.get("equivalence_key") in matching]
    if exp_names:
        wanted = set(exp_names)
        runs = [r for r in runs if r.data.tags.get("dvc.exp_name") in wanted or r.info.run_name in wanted]
        found = {r.data.tags.get("dvc.exp_name") for r in runs} | {r.info.run_name for r in runs}
        missing = sorted(wanted - found)
        if missing:
            raise UserError(f"no training run for DVC experiment(s) {', '.join(missing)} in MLflow "
                            "experiment; `dvc exp show` lists the names (a run from before "
                            "`dvc exp run` has none)")
    runs.sort(key=lambda r: (r.info.start_time or 0, r.info.run_id))
    return [_run_record(tracker, r) for r in runs]


def log_comparison(tracker: Tracker, files: list[str | os.PathLike], run_ids: list[str],
                   keys: list[str], summary: dict[str, float] | None = None) -> str:
    """Create a FINISHED comparison run (tag ``stage=compare``; ``equivalence_key`` when the comparison
    covers one key) whose artifacts are ``files`` (the report and its plots); return its id.

    Tags ``compare.run_ids`` and ``compare.keys`` name what was compared (comma-separated, truncated
    to MLflow's tag length); ``summary`` values are logged as metrics (counts of runs).
    """
    tags = {**run_context_tags(), "stage": "compare",
            "compare.run_ids": ",".join(run_ids)[:5000], "compare.keys": ",".join(keys)[:5000]}
    if len(keys) == 1:
        tags["equivalence_key"] = keys[0]
    name = f"compare-{keys[0][:8]}" if len(keys) == 1 else "compare"
    run_id = tracker.start_run(name, tags)
    with tracker.guard(run_id, finish=True):
        for f in files:
            tracker.log_artifact(run_id, f)
        if summary:
            tracker.log_metrics(run_id, summary)
    return run_id


def check_reachable(uri: str, timeout_s: float = 5.0) -> None:
    """Fail fast when an http(s) tracking server does not accept a TCP connection.

    MLflow's REST client retries a refused or unroutable server with backoff for minutes before it
    raises; this opens one TCP connection (to the server, or to the proxy that would carry the
    request) within ``timeout_s`` instead. Other schemes are left alone.

    Raises:
        UserError: the host cannot be resolved, or refuses or does not answer the connection.
    """
    import socket
    import urllib.request
    u = urlparse(uri)
    if u.scheme not in ("http", "https"):
        return
    try:
        host, port = u.hostname, u.port or (443 if u.scheme == "https" else 80)
    except ValueError as e:  # a port that is not a number or out of range
        raise UserError(f"MLFLOW_TRACKING_URI={redact(uri)!r} is malformed: {e}") from None
    if not host:
        raise UserError(f"MLFLOW_TRACKING_URI={redact(uri)!r} has no host; use http(s)://HOST:PORT")
    target, via = (host, port), ""
    proxy = urllib.request.getproxies().get(u.scheme)
    if proxy and not urllib.request.proxy_bypass(host):
        pu = urlparse(proxy if "://" in proxy else f"http://{proxy}")
        target, via = (pu.hostname or "", pu.port or 80), f" through the proxy {pu.hostname}:{pu.port or 80}"
    try:
        with socket.create_connection(target, timeout=timeout_s):
            return
    except OSError as e:
        reason = "no answer" if isinstance(e, socket.timeout) else (e.strerror or type(e).__name__)
        raise UserError(f"MLFLOW_TRACKING_URI={redact(uri)!r}: the tracking server cannot be reached{via} "
                        f"({reason}, {timeout_s:g} s timeout); start it (mlflow server --host {host} "
                        f"--port {port}) or unset MLFLOW_TRACKING_URI to use <project root>/mlflow.db") from None


# -- the spool: tracking writes that waited out an outage ---------------------------------------------

def _apply(client, run_id: str, kind: str, items: list) -> None:
    """Send one spooled-format write to the store."""
    from mlflow.entities import Metric, Param, RunTag
    if kind == "metrics":
        client.log_batch(run_id, metrics=[Metric(k, v, ts, st) for k, v, ts, st in items], synchronous=True)
    elif kind == "params":
        client.log_batch(run_id, params=[Param(k, v) for k, v in items], synchronous=True)
    elif kind == "tags":
        client.log_batch(run_id, tags=[RunTag(k, v) for k, v in items], synchronous=True)
    elif kind == "status":
        client.set_terminated(run_id, status=items[0])
    elif kind == "reopen":
        client.update_run(run_id, status=items[0])
    else:
        raise ValueError(f"unknown spool record kind {kind!r}")


def _is_outage(e: Exception) -> bool:
    """Errors that mean "the store is not there now", not "this write is wrong"."""
    import requests
    from mlflow.exceptions import MlflowException
    if isinstance(e, (requests.exceptions.ConnectionError, requests.exceptions.Timeout, ConnectionError,
                      TimeoutError)):
        return True
    text = str(e)
    return isinstance(e, MlflowException) and any(
        w in text for w in ("Max retries exceeded", "Connection refused", "timed out", "API request to",
                            "database is locked", "ConnectionError", "Failed to establish"))


class Spool:
    """``<spool_dir>/<run_id>.jsonl``: one JSON line per write that could not reach the store."""

    def __init__(self, spool_dir: Path, run_id: str) -> None:
        self.path = Path(spool_dir) / f"{run_id}.jsonl"
        self.run_id = run_id

    def pending(self) -> bool:
        return self.path.is_file() and self.path.stat().st_size > 0

    def append(self, kind: str, items: list) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps({"kind": kind, "items": items}) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def replay(self, client) -> int:
        """Write every spooled record in order; the file is removed once all are in. Returns records
        written. Raises what the store raises (the rest stays spooled)."""
        lines = [ln for ln in self.path.read_text().splitlines() if ln.strip()]
        done = 0
        try:
            for ln in lines:
                rec = json.loads(ln)
                _apply(client, self.run_id, rec["kind"], rec["items"])
                done += 1
        finally:
            rest = lines[done:]
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text("".join(ln + "\n" for ln in rest))
            os.replace(tmp, self.path)
            if not rest:
                self.path.unlink()
        return done


def sync(root: Path | None = None) -> tuple[int, int]:
    """Replay every run's spool into the store (``onegpu sync``). Returns (runs, records) written.

    Raises:
        UserError: the store is still unreachable (the spool is kept).
    """
    from mlflow import MlflowClient
    root = root or paths.project_root()
    uri = paths.tracking_uri(root)
    _check_uri(uri)
    try:
        check_reachable(uri)
    except UserError as e:
        raise UserError(f"{e}; the store is still unreachable, so the spool in {paths.spool_dir(root)} "
                        "is kept") from None
    client = MlflowClient(tracking_uri=uri)
    runs = records = 0
    for f in sorted(paths.spool_dir(root).glob("*.jsonl")):
        try:
            records += Spool(f.parent, f.stem).replay(client)
        except Exception as e:
            if _is_outage(e):
                raise UserError(f"the MLflow store {redact(uri)} is still unreachable; the spool is kept "
                                f"in {f.parent}") from None
            raise
        runs += 1
    return runs, records
