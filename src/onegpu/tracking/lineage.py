"""Which run evaluate logs into, also for a model trained in another clone (a pulled experiment).

``models/mlflow_run.json`` (a DVC-tracked output, so ``dvc exp pull`` / ``dvc pull`` bring it with the
model) names the training run: its id, and since this module, the store it lives in (``tracking_uri``,
credentials redacted) and its name. :func:`open_evaluation_run` decides:

- this clone's store has that run (both clones share one store through ``MLFLOW_TRACKING_URI``):
  re-open it and log into it, as in the clone that trained;
- it does not (each clone keeps its own ``<project root>/mlflow.db``, or another server): log into a
  run of this store that reproduces it, tagged ``onegpu.reproduces_run_id`` (and
  ``onegpu.reproduces_store``); the first evaluation creates it (tag ``stage=evaluate``, so
  ``onegpu compare`` and the UI's training view leave it out), later ones re-open it. Where the
  original's store can be reached from here, the original gets the link back: ``onegpu.reproduced_by``
  (run ids, comma-separated) and ``onegpu.reproduced_by_store``.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from onegpu.tracking.runs import run_context_tags
from onegpu.tracking.uri import check_reachable, redact

REPRODUCES_RUN_ID = "onegpu.reproduces_run_id"
REPRODUCES_STORE = "onegpu.reproduces_store"
REPRODUCED_BY = "onegpu.reproduced_by"
REPRODUCED_BY_STORE = "onegpu.reproduced_by_store"


def run_record(run_id: str, experiment_id: str, equivalence_key: str, uri: str, run_name: str | None,
               logged_model: dict | None = None) -> dict:
    """The contents of ``models/mlflow_run.json``: ids, ``equivalence_key``, ``run_name``, the store's
    URI with any password replaced by ``***`` (it is kept by DVC and pushed to remotes) and ``logged_model``
    (the fields of the :class:`onegpu.tracking.ModelSpec` train logged, for evaluate; absent when None)."""
    record = {"run_id": run_id, "experiment_id": experiment_id, "equivalence_key": equivalence_key,
              "run_name": run_name, "tracking_uri": redact(uri)}
    return {**record, "logged_model": logged_model} if logged_model else record


def open_evaluation_run(tracker, record: dict, params: dict[str, Any]) -> tuple[str, str | None]:
    """Open the run that evaluate logs into and return ``(run_id, reproduced_run_id)``; the second is
    None when that is the training run itself (found in this store), else the training run's id.

    ``record``: ``models/mlflow_run.json`` (``run_id`` required; ``tracking_uri``, ``run_name``,
    ``equivalence_key`` used when present). ``params``: the flattened params.yaml, logged on a new
    reproducing run. The run is left RUNNING with this process as its writer; end it with
    ``tracker.guard``.

    Raises:
        UserError: the training run is in this store but deleted (:meth:`RunHandle.reopen`), or the
            store cannot be read.
    """
    original = record["run_id"]
    if _in_store(tracker.client, original):
        tracker.resume_run(original)
        return original, None
    existing = _reproducing_run(tracker, original)
    if existing is not None:
        tracker.resume_run(existing)
        return existing, original
    origin_uri = record.get("tracking_uri")
    tags = {**run_context_tags(), "stage": "evaluate", REPRODUCES_RUN_ID: original}
    if origin_uri:
        tags[REPRODUCES_STORE] = origin_uri
    if record.get("equivalence_key"):
        tags["equivalence_key"] = record["equivalence_key"]
    run_id = tracker.start_run(record.get("run_name") or None, tags)
    tracker.log_params(run_id, params)
    if origin_uri and origin_uri != redact(tracker.uri):
        _link_back(origin_uri, original, run_id, redact(tracker.uri))
    return run_id, original


def _in_store(client, run_id: str) -> bool:
    """False only when the store answers that it has no run ``run_id``; any other failure counts as
    present, so that re-opening it reports the real problem (an outage, a deleted run)."""
    try:
        client.get_run(run_id)
    except Exception as e:
        return getattr(e, "error_code", None) != "RESOURCE_DOES_NOT_EXIST"
    return True


def _reproducing_run(tracker, original: str) -> str | None:
    """The newest live run of the tracker's experiment tagged as reproducing ``original``, or None."""
    found = tracker.client.search_runs([tracker.experiment_id],
                                       filter_string=f"tags.`{REPRODUCES_RUN_ID}` = '{original}'",
                                       order_by=["attributes.start_time DESC"], max_results=1)
    return found[0].info.run_id if found else None


def _reachable(uri: str) -> bool:
    """Whether the store at ``uri`` can be opened from here without creating anything: a SQLite file
    or file store that exists, a server that accepts a connection (2 s), any other database URI."""
    u = urlparse(uri)
    if "***" in uri:
        return False  # recorded redacted: the password is not ours to know
    if u.scheme == "sqlite":
        return Path(unquote(uri[len("sqlite:///"):])).is_file()
    if u.scheme in ("file", ""):
        return Path(unquote(u.path)).is_dir()
    try:
        check_reachable(uri, timeout_s=2.0)
    except Exception:
        return False
    return True


def _link_back(origin_uri: str, original: str, run_id: str, here: str) -> None:
    """Tag the original run (in its own store) with the run that reproduces it; say so on stderr when
    that store cannot be reached or written (the link on this side stands anyway)."""
    from mlflow import MlflowClient
    try:
        if not _reachable(origin_uri):
            raise ConnectionError("not reachable from here")
        client = MlflowClient(tracking_uri=origin_uri)
        before = client.get_run(original).data.tags.get(REPRODUCED_BY, "")
        ids = [i for i in before.split(",") if i.strip()] + [run_id]
        client.set_tag(original, REPRODUCED_BY, ",".join(ids))
        client.set_tag(original, REPRODUCED_BY_STORE, here)
    except Exception as e:
        print(f"onegpu: the training run {original} is in {origin_uri}, which cannot be tagged from here "
              f"({type(e).__name__}: {str(e)[:200]}); only this run links to it ({REPRODUCES_RUN_ID})",
              file=sys.stderr, flush=True)
