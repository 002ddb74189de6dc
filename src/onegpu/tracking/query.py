"""Compare-time queries: reading training runs back (params, tags, per-step histories, time windows)
and logging the comparison run. Used by ``onegpu compare``; the records are plain dicts with the
fields of :class:`onegpu.compare.RunRecord`."""
from __future__ import annotations

import os

from onegpu.errors import UserError
from onegpu.tracking.runs import run_context_tags
from onegpu.tracking.store import Tracker
from onegpu.tracking.uri import redact

# Per-step metrics (MLflow step = optimizer step, from 1) fetched for a comparison; eval_loss: the validation
# points, at the steps they followed.
STEP_SERIES = ("loss", "grad_norm", "learning_rate", "step_time_s", "samples_per_second", "mem_peak_bytes",
               "step_examples", "step_compile_s", "eval_loss")
TRAINING = "tags.stage = 'train'"


def metric_histories(tracker: Tracker, run_id: str,
                     keys: tuple[str, ...] = STEP_SERIES) -> dict[str, list[tuple[int, float]]]:
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


def _search(tracker: Tracker, filter_string: str) -> list:
    """Every run of the tracker's experiment that ``filter_string`` matches, all pages of the search.
    (The client's, not ``mlflow.search_runs``: that pages too but reads the process-wide tracking URI.)"""
    runs, token = [], None
    while True:
        page = tracker.client.search_runs([tracker.experiment_id], filter_string=filter_string,
                                          max_results=1000, page_token=token)
        runs.extend(page)
        token = page.token
        if not token:
            return runs


def _all_training_runs(tracker: Tracker) -> list:
    """Every training run of the experiment."""
    return _search(tracker, TRAINING)


def training_run_windows(tracker: Tracker) -> list[dict]:
    """Every training run of the experiment with its tags only (no histories): RunRecord fields
    ``run_id``, ``name``, ``tags``, ``start_time``, for overlap checks against runs outside a filter."""
    return [{"run_id": r.info.run_id, "name": r.info.run_name or "", "tags": dict(r.data.tags),
             "start_time": int(r.info.start_time or 0)} for r in _all_training_runs(tracker)]


def _runs_by_id(tracker: Tracker, run_ids: list[str]) -> list:
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
    return runs


def _with_key(runs: list, key: str) -> list:
    keys = {r.data.tags.get("equivalence_key") for r in runs}
    matching = [key] if key in keys else sorted(k for k in keys if k and k.startswith(key))
    if len(matching) > 1:
        raise UserError(f"--key {key!r} matches several equivalence keys: {', '.join(matching)}")
    return [r for r in runs if r.data.tags.get("equivalence_key") in matching]


def _of_experiments(runs: list, exp_names: list[str]) -> list:
    wanted = set(exp_names)
    runs = [r for r in runs if r.data.tags.get("dvc.exp_name") in wanted or r.info.run_name in wanted]
    found = {r.data.tags.get("dvc.exp_name") for r in runs} | {r.info.run_name for r in runs}
    missing = sorted(wanted - found)
    if missing:
        raise UserError(f"no training run for DVC experiment(s) {', '.join(missing)} in MLflow "
                        "experiment; `dvc exp show` lists the names (a run from before "
                        "`dvc exp run` has none)")
    return runs


def training_runs(tracker: Tracker, key: str | None = None, run_ids: list[str] | None = None,
                  exp_names: list[str] | None = None) -> list[dict]:
    """The training runs (tag ``stage=train``) of the tracker's experiment, with full per-step histories.

    Filters (all that are given apply):
        key: the ``equivalence_key`` tag, or a unique prefix of it.
        run_ids: these runs only (each must exist and be a training run; it may be in another experiment).
        exp_names: runs whose ``dvc.exp_name`` tag (or run name) is one of these DVC experiment names.
    Returns:
        Dicts with the fields of :class:`onegpu.compare.RunRecord` (run_id, name, params, tags,
        metrics = last values, series = per-step histories of :data:`STEP_SERIES`, start_time in ms,
        status), oldest first.
    Raises:
        UserError: a run id does not exist or is not a training run, a key prefix is ambiguous, or an
            experiment name matches no training run.
    """
    runs = _runs_by_id(tracker, run_ids) if run_ids else _all_training_runs(tracker)
    if key:
        runs = _with_key(runs, key)
    if exp_names:
        runs = _of_experiments(runs, exp_names)
    runs.sort(key=lambda r: (r.info.start_time or 0, r.info.run_id))
    return [_run_record(tracker, r) for r in runs]


def training_runs_named(tracker: Tracker, prefix: str) -> list[dict]:
    """The training runs whose run name (the DVC experiment name) starts with ``prefix``, with full
    per-step histories, as :func:`training_runs` returns them (oldest first)."""
    escaped = prefix.replace("'", "\\'")
    runs = _search(tracker, f"{TRAINING} AND attributes.run_name LIKE '{escaped}%'")
    runs.sort(key=lambda r: (r.info.start_time or 0, r.info.run_id))
    return [_run_record(tracker, r) for r in runs]


def log_comparison(tracker: Tracker, files: list[str | os.PathLike], run_ids: list[str],
                   keys: list[str], summary: dict[str, float] | None = None, stage: str = "compare",
                   name: str | None = None) -> str:
    """Create a FINISHED comparison run (tag ``stage``, ``compare`` by default; ``equivalence_key`` when
    the comparison covers one key; run name ``name``, by default ``compare[-<key>]``) whose artifacts are
    ``files`` (the report and its plots); return its id.

    Tags ``compare.run_ids`` and ``compare.keys`` name what was compared (comma-separated, truncated
    to MLflow's tag length); ``summary`` values are logged as metrics (counts of runs).
    """
    tags = {**run_context_tags(), "stage": stage,
            "compare.run_ids": ",".join(run_ids)[:5000], "compare.keys": ",".join(keys)[:5000]}
    if len(keys) == 1:
        tags["equivalence_key"] = keys[0]
    name = name or (f"compare-{keys[0][:8]}" if len(keys) == 1 else "compare")
    run = tracker.run(tracker.start_run(name, tags))
    with run.guard(finish=True):
        for f in files:
            run.log_artifact(f)
        if summary:
            run.log_metrics(summary)
    return run.run_id
