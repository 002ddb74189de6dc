"""One run: :class:`RunHandle` writes a run's params, tags, metrics, artifacts and status; the run
lifecycle (its writer, re-opening an ended run, reaping orphans) and the tags every run carries.

Run lifecycle: a run is RUNNING only while a process writes to it. Train creates the run and ends it
(SCHEDULED: trained, evaluation to come; or FAILED/KILLED) when the stage ends; evaluate re-opens the
same run id (:func:`reopen`) and ends it FINISHED. Every run records its writer (tags
``onegpu.writer.host``, ``onegpu.writer.pid``, ``onegpu.writer.started``); whenever a stage opens a run,
RUNNING runs of the experiment whose writer process is gone from this host (SIGKILL, the OOM killer, a
power loss) are marked KILLED with the tag ``onegpu.killed_reason`` (:func:`reap_orphans`).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from onegpu.errors import UserError
from onegpu.tracking.spool import SpoolingWriter, is_outage
from onegpu.tracking.uri import redact
from onegpu.tracking.writer import MetricBuffer

# MLflow limits (mlflow/utils/validation.py): param values are at most 6000 characters.
_MAX_PARAM_LEN = 6000

# Who writes to a run (set when a stage opens it): a RUNNING run whose writer is gone is an orphan.
WRITER_HOST, WRITER_PID, WRITER_STARTED = "onegpu.writer.host", "onegpu.writer.pid", "onegpu.writer.started"
KILLED_REASON = "onegpu.killed_reason"
# Tag on a run whose param value was cut at MLflow's limit: the keys, comma-separated.
TRUNCATED_PARAMS = "onegpu.truncated_params"
# The run's description (Markdown), on top of MLflow's run page.
NOTE_TAG = "mlflow.note.content"
# A dataset input's tag: the DVC-tracked version the run read the split from (``data/processed@<md5>.dir``).
DVC_OUT_TAG = "onegpu.dvc_out"


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


def over(note: str, before: str | None) -> str:
    """The run description ``note`` (Markdown) put first, over the one the run had (``before``; None: none)."""
    return f"{note}\n\n{before}" if before else note


def killed_note(run, why: str) -> str:
    """The description (Markdown) of a run marked KILLED because its writer is gone (``why``): what happened,
    and how to go on: train again (it resumes from the newest checkpoint), or, when the training had
    finished (``train_runtime`` logged) and its evaluation was killed, run the pipeline again."""
    if "train_runtime" in run.data.metrics:
        then = "the training had finished: `dvc repro` (or the same `dvc exp run`) runs its evaluation again."
    else:
        then = ("the steps it wrote are in its metrics. To resume: train again (`dvc repro`, or the same "
                "`dvc exp run`), from the newest checkpoint `train.save_steps` wrote, if any.")
    return f"**Killed outright** (KILLED): {why}; {then}"


def reap_orphans(client, experiment_id: str, on_reaped=None) -> list[str]:
    """Mark KILLED every RUNNING run of ``experiment_id`` whose writer process is gone from this host
    (tag ``onegpu.killed_reason`` says why; the description, :data:`NOTE_TAG`, says it first, over what it
    held) and return their ids. ``on_reaped(run, note)``, when given, is called for each (the train stage
    draws the run's figure from its logged steps); its failure is ignored. Runs on other hosts, runs without
    writer tags and live writers are left alone; a store that cannot be searched is skipped."""
    try:
        runs = client.search_runs([experiment_id], filter_string="attributes.status = 'RUNNING'",
                                  max_results=1000)
    except Exception:
        return []
    reaped = []
    for run in runs:
        why = writer_gone(run.data.tags)
        if why is None:
            continue
        # A stage that ends, fails or is stopped (SIGINT/SIGTERM) ends its run: one left RUNNING was killed
        # outright (SIGKILL, which the kernel's out-of-memory killer sends), crashed, or lost power.
        why += (" without ending the run (killed outright: SIGKILL, e.g. the out-of-memory killer (see dmesg), "
                "a crash or a power loss)")
        note = killed_note(run, why)
        try:
            client.set_tag(run.info.run_id, KILLED_REASON, f"left RUNNING: {why}")
            client.set_tag(run.info.run_id, NOTE_TAG, over(note, run.data.tags.get(NOTE_TAG)))
            client.set_terminated(run.info.run_id, status="KILLED")
        except Exception:
            continue
        reaped.append(run.info.run_id)
        if on_reaped is not None:
            try:
                on_reaped(run, note)
            except Exception:
                pass
        print(f"onegpu: MLflow run {run.info.run_name or ''} {run.info.run_id} was left RUNNING and {why}; "
              "marked KILLED", file=sys.stderr, flush=True)
    return reaped


@dataclass
class RunHandle:
    """Writes to one MLflow run, ``run_id``, through ``writer`` (spooled during an outage); artifacts
    go straight to ``client``."""
    client: Any
    run_id: str
    writer: SpoolingWriter

    # -- status -------------------------------------------------------------------------------
    def status(self) -> str | None:
        """The run's status (RUNNING, SCHEDULED, FINISHED, FAILED, KILLED), or None when unreadable."""
        try:
            return self.client.get_run(self.run_id).info.status
        except Exception:
            return None

    def end(self, status: str = "FINISHED") -> None:
        """End the run with ``status``: FINISHED, FAILED, KILLED, or SCHEDULED (trained, not yet evaluated)."""
        self.writer.write(self.run_id, "status", [status])

    def reopen(self) -> None:
        """Re-open the ended run (status RUNNING again, this process as its writer) to log more into it;
        end it again with :meth:`end` or :meth:`guard`. MLflow allows logging to a terminated run; this
        only makes its status tell the truth while a process writes.

        Raises:
            UserError: the run does not exist in this store, or is deleted.
        """
        uri = redact(self.writer.uri)
        try:
            run = self.client.get_run(self.run_id)
        except Exception as e:
            if is_outage(e):
                raise
            raise UserError(f"MLflow run {self.run_id} is not in {uri}; train again "
                            "(`dvc repro -f train`)") from None
        if run.info.lifecycle_stage == "deleted":
            raise UserError(f"MLflow run {self.run_id} is deleted in {uri}; restore it "
                            f"(MLFLOW_TRACKING_URI={uri} mlflow runs restore --run-id {self.run_id}) "
                            "or train again (`dvc repro -f train`)")
        self.set_tags(writer_tags())  # before the status: a reaper must never see a dead writer
        self.writer.write(self.run_id, "reopen", ["RUNNING"])

    @contextmanager
    def guard(self, finish: bool | str = True, context=None, note=None):
        """End the run FAILED (KILLED on Ctrl-C or SIGTERM) with the error as tags if the block raises;
        if it returns, FINISHED when ``finish`` is true, or the status ``finish`` names (train ends its run
        SCHEDULED: trained, its evaluate stage still to come). A run that ``finish=False`` leaves RUNNING
        must be ended by the same process: no run stays RUNNING without a writer.
        ``context``: a callable returning more tags for the error (e.g. ``error.step``); ``note``: a callable
        ``(error) -> Markdown`` put first in the run's description (:data:`NOTE_TAG`), over what it held."""
        try:
            yield self
        except BaseException as e:
            try:
                extra = context() if context else {}
                if getattr(e, "step", None) is not None:  # the error knows its optimizer step
                    extra["error.step"] = str(e.step)
                if note is not None:
                    before = self.client.get_run(self.run_id).data.tags.get(NOTE_TAG)
                    extra[NOTE_TAG] = over(redact(note(e), self.writer.uri), before)
                message = redact(str(e), self.writer.uri)[:5000]  # MLflow's errors quote the store URL
                self.set_tags({"error.type": type(e).__name__, "error.message": message, **extra})
                self.end("KILLED" if isinstance(e, KeyboardInterrupt) else "FAILED")
            except Exception:
                pass  # the store itself failed: the original error is what the user needs
            raise
        else:
            if finish:
                self.end(finish if isinstance(finish, str) else "FINISHED")

    # -- params, tags, metrics ----------------------------------------------------------------
    def log_params(self, params: dict[str, Any]) -> None:
        """Log params (values as strings, ``None`` as ``'None'``) in batches of 100.

        A value longer than MLflow's limit (6,000 characters) is cut to it, and the run gets the tag
        ``onegpu.truncated_params`` naming the cut keys (comma-separated) with their full lengths."""
        items = [[k, str(v)[:_MAX_PARAM_LEN]] for k, v in params.items()]
        cut = {k: len(str(v)) for k, v in params.items() if len(str(v)) > _MAX_PARAM_LEN}
        self._write_batches("params", items, 100)
        if cut:
            self.set_tags({TRUNCATED_PARAMS: ", ".join(
                f"{k} ({n} characters, cut to {_MAX_PARAM_LEN})" for k, n in cut.items())[:5000]})

    def set_tags(self, tags: dict[str, str]) -> None:
        """Set tags (values as strings) in batches of 100."""
        self._write_batches("tags", [[k, str(v)] for k, v in tags.items()], 100)

    def log_metrics(self, metrics: dict[str, float], step: int = 0, model_id: str | None = None,
                    dataset: tuple[str, str] | None = None) -> None:
        """Log several scalar metrics at one ``step`` in one batch (``None`` values skipped), now; with
        ``model_id`` (a logged model's) and ``dataset`` (``(name, digest)`` of a dataset input) they are also
        that model's metrics on that dataset (MLflow's Models tab)."""
        ts = int(time.time() * 1000)
        link = [model_id, *(dataset or (None, None))] if model_id or dataset else []
        self._write_batches("metrics", [[k, float(v), ts, step, *link] for k, v in metrics.items() if v is not None],
                            1000)

    def _write_batches(self, kind: str, items: list, size: int) -> None:
        for i in range(0, len(items), size):
            self.writer.write(self.run_id, kind, items[i:i + size])

    def metric_buffer(self, flush_every: int = 200, flush_seconds: float = 30.0) -> MetricBuffer:
        """A :class:`~onegpu.tracking.writer.MetricBuffer` for per-step metrics of this run (written
        by a background thread; call its ``flush`` when the run ends)."""
        return MetricBuffer(self.writer.write, self.run_id, flush_every=flush_every, flush_seconds=flush_seconds)

    # -- artifacts and inputs -----------------------------------------------------------------
    def _artifact(self, artifact_file: str):
        """Around writing one artifact (:func:`onegpu.paths.writing`): a full disk names where the artifact
        went (the run's artifact folder, or its URI on a server), looked up only then."""
        from onegpu import paths

        def where() -> str:
            uri = self.client.get_run(self.run_id).info.artifact_uri
            return os.path.join(uri[len("file://"):] if uri.startswith("file://") else uri, artifact_file)
        return paths.writing(where)

    def log_artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        with self._artifact(os.path.join(artifact_path or "", os.path.basename(str(path)))):
            self.client.log_artifact(self.run_id, str(path), artifact_path)

    def log_dict(self, obj: dict, artifact_file: str) -> None:
        with self._artifact(artifact_file):
            self.client.log_dict(self.run_id, obj, artifact_file)

    def log_text(self, text: str, artifact_file: str) -> None:
        with self._artifact(artifact_file):
            self.client.log_text(self.run_id, text, artifact_file)

    def log_figure(self, figure, artifact_file: str) -> None:
        with self._artifact(artifact_file):
            self.client.log_figure(self.run_id, figure, artifact_file)

    def log_table(self, data: dict[str, list], artifact_file: str) -> None:
        """A table (column name -> equal-length list of values) as MLflow's table artifact
        (``MlflowClient.log_table``: a ``.json`` file the UI shows in its evaluation view)."""
        with self._artifact(artifact_file):
            self.client.log_table(self.run_id, data=data, artifact_file=artifact_file)

    def log_dataset(self, df, name: str, source: str, context: str, targets: str | None = None,
                    tags: dict[str, str] | None = None) -> tuple[str, str]:
        """Record a pandas DataFrame as an MLflow dataset input (schema, digest, source) of the run, with its
        ``context`` and ``tags`` as the input's tags. MLflow keeps one dataset per name and digest in an
        experiment: its source is the one first logged (prepare's, for a split); ``tags`` are this run's.
        Returns the dataset's ``(name, digest)``."""
        import warnings

        import mlflow.data
        from mlflow.entities import DatasetInput, InputTag
        with warnings.catch_warnings():  # "source can be interpreted in multiple ways": both are local
            warnings.simplefilter("ignore", UserWarning)
            ds = mlflow.data.from_pandas(df, source=source, name=name, targets=targets)
        input_tags = [InputTag("mlflow.data.context", context)] + [InputTag(k, v) for k, v in (tags or {}).items()]
        self.client.log_inputs(self.run_id, [DatasetInput(ds._to_mlflow_entity(), input_tags)])
        return ds.name, ds.digest

    @contextmanager
    def system_metrics(self, interval_s: float = 5.0, resume: bool = False):
        """MLflow's system-metrics monitor (CPU, memory, disk, network; GPU utilisation and power via
        NVML where a GPU is) logging into the run every ``interval_s`` seconds while the block runs.

        Its figures are machine-wide (MLflow's design); the process's own memory is in ``mem_*``.
        A monitor that cannot start is skipped: it never stops training.
        """
        import logging
        logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)  # start/stop chatter
        monitor = None
        try:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor
            monitor = SystemMetricsMonitor(self.run_id, sampling_interval=interval_s, samples_before_logging=1,
                                           resume_logging=resume, tracking_uri=self.writer.uri)
            monitor.start()
        except Exception:
            monitor = None
        try:
            yield
        finally:
            if monitor is not None:
                monitor.finish()


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
    for tag, var in (("dvc.exp_name", "DVC_EXP_NAME"), ("dvc.baseline_rev", "DVC_EXP_BASELINE_REV"),
                     ("dvc.stage", "DVC_STAGE")):
        if os.environ.get(var):
            tags[tag] = os.environ[var]
    return tags


def run_name() -> str | None:
    """The DVC experiment name when there is one; else None (MLflow picks a name)."""
    return os.environ.get("DVC_EXP_NAME") or None
