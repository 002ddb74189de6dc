"""Everything MLflow: the store, the experiment, runs, params and tags, batched metrics, artifacts.

The only module that imports mlflow. It uses ``MlflowClient`` with explicit run ids (no global
"active run"), so a train stage can leave its run open for the evaluate stage, which closes it.

Store and experiment creation are serialised with a file lock in the project root: several processes
opening a *fresh* SQLite store at once crash creating its schema, and several setting a *new* experiment
at once can silently log into experiment 0 (measured here, see ../shared/design.md).
"""
from __future__ import annotations

import os
import subprocess
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
    """A connection to the project's store and experiment."""
    client: Any
    experiment_id: str
    uri: str

    # -- runs ---------------------------------------------------------------------------------
    def start_run(self, run_name: str | None, tags: dict[str, str]) -> str:
        """Create a run (status RUNNING) and return its id."""
        run = self.client.create_run(self.experiment_id, run_name=run_name, tags=tags)
        return run.info.run_id

    def end_run(self, run_id: str, status: str = "FINISHED") -> None:
        """Set the run's status: FINISHED, FAILED or KILLED."""
        self.client.set_terminated(run_id, status=status)

    @contextmanager
    def guard(self, run_id: str, finish: bool = True):
        """End ``run_id`` FAILED (KILLED on Ctrl-C) with the error as tags if the block raises;
        FINISHED if it returns and ``finish`` is true (train leaves its run open for evaluate)."""
        try:
            yield
        except BaseException as e:
            killed = isinstance(e, KeyboardInterrupt)
            try:
                self.set_tags(run_id, {"error.type": type(e).__name__, "error.message": str(e)[:5000]})
                self.end_run(run_id, "KILLED" if killed else "FAILED")
            except Exception:
                pass  # the store itself failed: the original error is what the user needs
            raise
        else:
            if finish:
                self.end_run(run_id, "FINISHED")

    def run_status(self, run_id: str) -> str | None:
        try:
            return self.client.get_run(run_id).info.status
        except Exception:
            return None

    # -- params, tags, metrics ----------------------------------------------------------------
    def log_params(self, run_id: str, params: dict[str, Any]) -> None:
        """Log params (values as strings, ``None`` as ``'None'``) in batches."""
        from mlflow.entities import Param
        items = [Param(k, str(v)[:_MAX_PARAM_LEN]) for k, v in params.items()]
        for i in range(0, len(items), 100):
            self.client.log_batch(run_id, params=items[i:i + 100], synchronous=True)

    def set_tags(self, run_id: str, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag
        items = [RunTag(k, str(v)) for k, v in tags.items()]
        for i in range(0, len(items), 100):
            self.client.log_batch(run_id, tags=items[i:i + 100], synchronous=True)

    def log_metrics(self, run_id: str, metrics: dict[str, float], step: int = 0) -> None:
        """Log several scalar metrics at one ``step`` in one batch."""
        from mlflow.entities import Metric
        ts = int(time.time() * 1000)
        items = [Metric(k, float(v), ts, step) for k, v in metrics.items() if v is not None]
        for i in range(0, len(items), 1000):
            self.client.log_batch(run_id, metrics=items[i:i + 1000], synchronous=True)

    def metric_buffer(self, run_id: str, flush_every: int = 200, flush_seconds: float = 30.0) -> "MetricBuffer":
        return MetricBuffer(self, run_id, flush_every=flush_every, flush_seconds=flush_seconds)

    # -- artifacts and inputs -----------------------------------------------------------------
    def log_artifact(self, run_id: str, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        self.client.log_artifact(run_id, str(path), artifact_path)

    def log_dict(self, run_id: str, obj: dict, artifact_file: str) -> None:
        self.client.log_dict(run_id, obj, artifact_file)

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
        from mlflow.entities import Metric
        ts = int(time.time() * 1000)
        self._items.extend(Metric(k, float(v), ts, step) for k, v in metrics.items() if v is not None)
        if len(self._items) >= self.flush_every or time.monotonic() - self._last > self.flush_seconds:
            self.flush()

    def flush(self) -> None:
        while self._items:
            chunk, self._items = self._items[:1000], self._items[1000:]
            self.tracker.client.log_batch(self.run_id, metrics=chunk, synchronous=True)
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
    default_store = paths.uses_default_store()
    with filelock.FileLock(str(paths.lock_file(root)), timeout=120):
        try:
            client = MlflowClient(tracking_uri=uri)
            exp = client.get_experiment_by_name(experiment_name)
            if exp is None:
                location = paths.artifact_root(root).as_uri() if default_store else None
                exp_id = client.create_experiment(experiment_name, artifact_location=location)
            else:
                if exp.lifecycle_stage == "deleted":
                    raise UserError(f"MLflow experiment {experiment_name!r} is deleted in {redact(uri)}; "
                                    "restore it in the UI or choose another tracking.experiment_name")
                exp_id = exp.experiment_id
        except UserError:
            raise
        except Exception as e:
            raise UserError(f"cannot open the MLflow store {redact(uri)}: {type(e).__name__}: {e}") from None
    return Tracker(client=client, experiment_id=exp_id, uri=uri)


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
