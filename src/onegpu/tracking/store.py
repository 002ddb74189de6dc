"""The store and one experiment in it: :func:`connect` (get or create, for writing), :func:`open_existing`
(read only), :func:`sync` (replay the outage spool), and :class:`Tracker`, the connection they return.

Store and experiment creation are serialised with a file lock in the project root: several processes
opening a *fresh* SQLite store at once crash creating its schema, and several setting a *new* experiment
at once can silently log into experiment 0 (measured on this project's SQLite stores).
"""
from __future__ import annotations

import logging
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from onegpu import paths
from onegpu.errors import UserError
from onegpu.tracking import models, runs
from onegpu.tracking.spool import SpoolingWriter, is_outage, replay_all
from onegpu.tracking.uri import redact, store_uri


@dataclass
class Tracker:
    """A connection to the project's store and experiment ``experiment_id``.

    ``spool_dir``: where writes that cannot reach the store wait (``<root>/.onegpu/spool``); None
    writes straight through and raises on failure. :meth:`run` gives the handle of one run; the
    methods taking a ``run_id`` first are shorthands for the handle's.
    """
    client: Any
    experiment_id: str
    uri: str
    spool_dir: Path | None = None
    writer: SpoolingWriter = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.writer = SpoolingWriter(self.client, self.uri, self.spool_dir)

    def run(self, run_id: str) -> runs.RunHandle:
        """The handle that writes to ``run_id`` (params, tags, metrics, artifacts, status)."""
        return runs.RunHandle(self.client, run_id, self.writer)

    def start_run(self, run_name: str | None, tags: dict[str, str], on_reaped=None) -> str:
        """Create a run (status RUNNING, this process as its writer) and return its id. Orphans of the
        experiment are reaped first (:meth:`reap_orphans`, ``on_reaped`` called for each)."""
        self.reap_orphans(on_reaped)
        run = self.client.create_run(self.experiment_id, run_name=run_name, tags={**tags, **runs.writer_tags()})
        return run.info.run_id

    def resume_run(self, run_id: str) -> None:
        """Reap orphans, then re-open the ended run ``run_id`` (:meth:`RunHandle.reopen`).

        Raises:
            UserError: the run does not exist in this store, or is deleted.
        """
        self.reap_orphans()
        self.run(run_id).reopen()

    def reap_orphans(self, on_reaped=None) -> list[str]:
        """Mark KILLED the experiment's RUNNING runs whose writer is gone (:func:`runs.reap_orphans`)."""
        return runs.reap_orphans(self.client, self.experiment_id, on_reaped)

    def find_run(self, run_id: str):
        """The MLflow run ``run_id`` (deleted ones too), or None when the store does not have it or
        cannot be read."""
        try:
            return self.client.get_run(run_id)
        except Exception:
            return None

    def runs_table_url(self, base: str) -> str:
        """The UI address of this experiment's training-runs table (not MLflow 3's GenAI overview)."""
        return f"{base.rstrip('/')}/#/experiments/{self.experiment_id}/runs"

    # -- shorthands for self.run(run_id).<method>: the stages' calls ---------------------------
    def run_status(self, run_id: str) -> str | None:
        return self.run(run_id).status()

    def end_run(self, run_id: str, status: str = "FINISHED") -> None:
        self.run(run_id).end(status)

    def guard(self, run_id: str, finish: bool | str = True, context=None, note=None):
        return self.run(run_id).guard(finish, context, note)

    def log_params(self, run_id: str, params: dict[str, Any]) -> None:
        self.run(run_id).log_params(params)

    def set_tags(self, run_id: str, tags: dict[str, str]) -> None:
        self.run(run_id).set_tags(tags)

    def log_metrics(self, run_id: str, metrics: dict[str, float], step: int = 0, model_id: str | None = None,
                    dataset: tuple[str, str] | None = None) -> None:
        self.run(run_id).log_metrics(metrics, step, model_id, dataset)

    def metric_buffer(self, run_id: str, flush_every: int = 200, flush_seconds: float = 30.0):
        return self.run(run_id).metric_buffer(flush_every, flush_seconds)

    def log_artifact(self, run_id: str, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        self.run(run_id).log_artifact(path, artifact_path)

    def log_dict(self, run_id: str, obj: dict, artifact_file: str) -> None:
        self.run(run_id).log_dict(obj, artifact_file)

    def log_text(self, run_id: str, text: str, artifact_file: str) -> None:
        self.run(run_id).log_text(text, artifact_file)

    def log_figure(self, run_id: str, figure, artifact_file: str) -> None:
        self.run(run_id).log_figure(figure, artifact_file)

    def log_table(self, run_id: str, data: dict[str, list], artifact_file: str) -> None:
        self.run(run_id).log_table(data, artifact_file)

    def log_dataset(self, run_id: str, df, name: str, source: str, context: str, targets: str | None = None,
                    tags: dict[str, str] | None = None) -> tuple[str, str]:
        return self.run(run_id).log_dataset(df, name, source, context, targets, tags)

    def log_data_inputs(self, run_id: str, inputs: list[tuple], version: str) -> list[tuple[str, str]]:
        """Each ``(DataFrame, name, context)`` of ``inputs`` as a dataset input of the run, targets ``label``,
        read from ``version`` (``data/processed@<DVC md5>``: the source where MLflow has no dataset of that
        name and digest yet, else it keeps the first one's, and the input's tag ``onegpu.dvc_out``).
        Returns each input's ``(name, digest)``."""
        return [self.log_dataset(run_id, df, name, version, context, "label", {runs.DVC_OUT_TAG: version})
                for df, name, context in inputs]

    def log_model(self, run_id: str, spec: models.ModelSpec) -> str | None:
        """The logged model of training run ``run_id`` (:mod:`onegpu.tracking.models`): the one the store has
        (``spec.tags`` set on it again: evaluate adds the DVC hash), else a new one of ``spec``. Returns its id;
        None when the store cannot be reached now (said once on stderr; the next stage that logs the model,
        evaluate, creates it), and the metrics then stay the run's alone.

        Raises:
            Exception: what the store raises when it is not an outage (or always, without a spool).
        """
        try:
            model_id = models.find(self.client, self.experiment_id, run_id)
            if model_id is None:
                return models.create(self.client, self.experiment_id, run_id, spec)
            self.client.set_logged_model_tags(model_id, spec.tags)
            return model_id
        except Exception as e:
            if self.spool_dir is None or not is_outage(e):
                raise
            print(f"onegpu: the MLflow store {redact(self.uri)} is unreachable ({type(e).__name__}): the trained "
                  "model is not recorded as a logged model now; evaluate records it", file=sys.stderr, flush=True)
            return None

    def system_metrics(self, run_id: str, interval_s: float = 5.0, resume: bool = False):
        return self.run(run_id).system_metrics(interval_s, resume)


def deleted_experiment_message(exp, uri: str, alternative: str) -> str:
    """One message for a deleted experiment, the same from every command: its name and id, and how to
    restore it (``mlflow experiments restore``) or what else to do (``alternative``)."""
    return (f"MLflow experiment {exp.name!r} (id {exp.experiment_id}) is deleted in {redact(uri)}; restore it "
            f"(MLFLOW_TRACKING_URI={redact(uri)} mlflow experiments restore --experiment-id {exp.experiment_id}, "
            f"or in the UI) or {alternative}")


@contextmanager
def _opening(uri: str):
    """Around opening the store: any failure but a UserError becomes "cannot open the MLflow store";
    MLflow's "Creating initial MLflow database tables..." log line is silenced."""
    db_log = logging.getLogger("mlflow.store.db.utils")
    old_level = db_log.level
    try:
        db_log.setLevel(logging.WARNING)
        yield
    except UserError:
        raise
    except Exception as e:
        raise UserError(f"cannot open the MLflow store {redact(uri)}: "
                        + redact(f"{type(e).__name__}: {e}", uri)) from None
    finally:
        db_log.setLevel(old_level)


def _experiment_id(client, uri: str, name: str, alternative: str) -> str | None:
    """The id of experiment ``name`` in the store, or None when it does not exist.

    Raises:
        UserError: the experiment is deleted (the message says how to restore it, or ``alternative``).
    """
    exp = client.get_experiment_by_name(name)
    if exp is not None and exp.lifecycle_stage == "deleted":
        raise UserError(deleted_experiment_message(exp, uri, alternative))
    return None if exp is None else exp.experiment_id


# MLflow 3's UI opens an experiment of no kind on its GenAI pages; this tag (its "Machine learning" kind,
# the value its UI names CUSTOM_MODEL_DEVELOPMENT) opens it on the training runs.
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")


def _create_experiment(client, uri: str, name: str, location: str | None) -> str:
    """Create experiment ``name``, of MLflow's machine-learning kind (:data:`EXPERIMENT_KIND`), and return its
    id; when another process created it since the look-up (the file lock covers one project root only: clones
    sharing a tracking server race here), its id.

    Raises:
        MlflowException: the create failed for another reason.
        UserError: the experiment the other process created is deleted already.
    """
    from mlflow.exceptions import MlflowException
    try:
        return client.create_experiment(name, artifact_location=location, tags=dict([EXPERIMENT_KIND]))
    except MlflowException as e:
        if e.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
        exp_id = _experiment_id(client, uri, name, "choose another tracking.experiment_name")
        if exp_id is None:
            raise
        return exp_id


def connect(experiment_name: str, root: Path | None = None) -> Tracker:
    """Open the project's store and get or create ``experiment_name``.

    Store: ``MLFLOW_TRACKING_URI`` if set, else ``sqlite:///<project root>/mlflow.db``; a new experiment
    on the default store keeps its artifacts in ``<project root>/mlartifacts`` (absolute, so a run from
    DVC's temp clone never points into a directory that is deleted).

    Raises:
        UserError: the URI is malformed, the server unreachable, the experiment deleted, or the store
            cannot be opened.
    """
    import filelock
    from mlflow import MlflowClient

    root = root or paths.project_root()
    uri = store_uri(root)
    if urlparse(uri).scheme in ("http", "https"):
        # MLflow's REST client retries for minutes by default; the spool takes over much sooner.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")
    location = paths.artifact_root(root).as_uri() if paths.uses_default_store() else None
    with filelock.FileLock(str(paths.lock_file(root)), timeout=120), _opening(uri):
        client = MlflowClient(tracking_uri=uri)
        exp_id = _experiment_id(client, uri, experiment_name, "choose another tracking.experiment_name")
        if exp_id is None:
            exp_id = _create_experiment(client, uri, experiment_name, location)
    return Tracker(client=client, experiment_id=exp_id, uri=uri, spool_dir=paths.spool_dir(root))


def open_existing(experiment_name: str, root: Path | None = None) -> Tracker:
    """Open the project's store and ``experiment_name`` for reading; create neither.

    Raises:
        UserError: the default store file does not exist yet, the experiment does not exist (the
            message lists the ones that do) or is deleted, or the store cannot be opened.
    """
    from mlflow import MlflowClient

    root = root or paths.project_root()
    uri = store_uri(root)
    if paths.uses_default_store() and not (root / "mlflow.db").is_file():
        raise UserError(f"no MLflow store at {root / 'mlflow.db'}: no training runs yet. Train first "
                        "(`dvc repro` or `dvc exp run -S ...`), or set MLFLOW_TRACKING_URI")
    with _opening(uri):
        client = MlflowClient(tracking_uri=uri)
        exp_id = _experiment_id(client, uri, experiment_name, "choose another with --experiment")
        names = [] if exp_id is not None else [e.name for e in client.search_experiments()]
    if exp_id is None:
        raise UserError(f"no MLflow experiment {experiment_name!r} in {redact(uri)}"
                        + (f"; experiments there: {', '.join(sorted(names))}" if names else "")
                        + " (choose one with --experiment)")
    return Tracker(client=client, experiment_id=exp_id, uri=uri)


def sync(root: Path | None = None) -> tuple[int, int]:
    """Replay every run's spool into the store (``onegpu sync``). Returns (runs, records) written.

    Raises:
        UserError: the store is still unreachable (the spool is kept).
    """
    from mlflow import MlflowClient
    root = root or paths.project_root()
    uri = store_uri(root, note=f"; the store is still unreachable, so the spool in {paths.spool_dir(root)} "
                               "is kept")
    return replay_all(MlflowClient(tracking_uri=uri), uri, paths.spool_dir(root))
