"""Everything MLflow; the only package that imports mlflow. It uses ``MlflowClient`` with explicit run
ids (no global "active run").

Modules, in dependency order (each imports only those above it):

- :mod:`~onegpu.tracking.uri`: which store (the tracking URI, its checks, credentials redacted);
- :mod:`~onegpu.tracking.spool`: writes that survive an outage (:func:`is_outage`, the spool, ``onegpu sync``'s
  replay);
- :mod:`~onegpu.tracking.writer`: :class:`MetricBuffer`, per-step metrics written by a background thread;
- :mod:`~onegpu.tracking.runs`: :class:`RunHandle` (one run's params, tags, metrics, artifacts, status), the run
  lifecycle (writer tags, re-opening, reaping orphans) and the tags every run carries;
- :mod:`~onegpu.tracking.models`: the trained model as an MLflow logged model whose files stay in DVC;
- :mod:`~onegpu.tracking.store`: :func:`connect`, :func:`open_existing`, :func:`sync` and :class:`Tracker`;
- :mod:`~onegpu.tracking.lineage`: the run evaluate logs into, also for a model trained in another clone;
- :mod:`~onegpu.tracking.query`: compare-time queries (training runs, histories, windows) and the comparison run.
"""
from onegpu.tracking.lineage import REPRODUCED_BY, REPRODUCES_RUN_ID, open_evaluation_run, run_record
from onegpu.tracking.models import ModelSpec
from onegpu.tracking.query import (
                                   STEP_SERIES,
                                   log_comparison,
                                   metric_histories,
                                   step_window,
                                   training_run_windows,
                                   training_runs,
                                   training_runs_named,
)
from onegpu.tracking.runs import (
                                   DVC_OUT_TAG,
                                   KILLED_REASON,
                                   TRUNCATED_PARAMS,
                                   WRITER_HOST,
                                   WRITER_PID,
                                   WRITER_STARTED,
                                   RunHandle,
                                   git_commit,
                                   run_context_tags,
                                   run_name,
                                   writer_gone,
                                   writer_tags,
)
from onegpu.tracking.spool import Spool, SpoolingWriter, is_outage
from onegpu.tracking.store import EXPERIMENT_KIND, Tracker, connect, deleted_experiment_message, open_existing, sync
from onegpu.tracking.uri import check_reachable, redact
from onegpu.tracking.writer import MetricBuffer

__all__ = ["EXPERIMENT_KIND", "REPRODUCED_BY", "REPRODUCES_RUN_ID", "open_evaluation_run", "run_record", "STEP_SERIES",
           "DVC_OUT_TAG", "KILLED_REASON", "TRUNCATED_PARAMS", "WRITER_HOST", "WRITER_PID", "WRITER_STARTED",
           "MetricBuffer", "ModelSpec", "RunHandle", "Spool", "SpoolingWriter", "Tracker", "check_reachable",
           "connect",
           "deleted_experiment_message", "git_commit", "is_outage", "log_comparison", "metric_histories",
           "open_existing", "redact", "run_context_tags", "run_name", "step_window", "sync",
           "training_run_windows", "training_runs", "training_runs_named", "writer_gone", "writer_tags"]
