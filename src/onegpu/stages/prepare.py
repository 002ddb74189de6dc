"""``onegpu prepare``: read, de-duplicate, split, tokenize -> data/processed/ and data/stats.json.

Logs a run of its own (tag ``stage=prepare``): ``prepare_runtime`` (s), ``prepare_rows_per_second``
(rows read / runtime), ``prepare_mem_peak_bytes`` (process RSS peak), ``rows_read``, ``rows_kept`` and
``rows_dropped_<reason>`` per reason (``data.DROP_REASONS`` of the data's format), ``prompts_truncated``,
the stats (artifact ``stats.json``), and each split as an MLflow dataset input (the format's columns and the
label names).
"""
from __future__ import annotations

from onegpu import data, paths, tracking
from onegpu.config import Config, flatten
from onegpu.data import describe, pipeline
from onegpu.errors import failure_note
from onegpu.measure import memory
from onegpu.models import loader


def _log_cost(tracker, run_id: str, metrics: dict) -> dict:
    try:
        tracker.log_metrics(run_id, metrics)
    except Exception:
        pass  # the store failed too: the error being reported matters more
    return {}


def run(cfg: Config) -> dict:
    watch = memory.Stopwatch()
    fmt = data.check_input(cfg)  # the data's form first: one line, before any heavy import or MLflow run
    from datasets.utils.logging import disable_progress_bar
    disable_progress_bar()
    loader.resolve_model_path(cfg.model.name_or_path)  # a missing model fails now (a packaged one converts once)
    tracking.uri.store_uri(paths.project_root())  # a malformed or unreachable store fails before the work
    # Everything that can refuse the data runs before the run opens: a bad input is not a failed run.
    dsd, tokenizer, stats, raw = pipeline.prepare(cfg, fmt, pipeline.tokenizer_maker(cfg))
    tracker = tracking.connect(cfg.tracking.experiment_name)
    run_id = tracker.start_run(tracking.run_name(), {**tracking.run_context_tags(), "stage": "prepare"})

    def cost() -> dict:
        """The contract's three prepare figures, logged on failure too: the attempt was measured."""
        runtime = watch.total()
        return {"prepare_runtime": runtime, "prepare_rows_per_second": stats["rows_read"] / runtime,
                "prepare_mem_peak_bytes": memory.rss_peak_bytes()}

    with tracker.guard(run_id, context=lambda: _log_cost(tracker, run_id, cost()), note=_failure_note):
        sections = {k: v for k, v in cfg.to_dict().items() if k in ("data", "model", "tracking")}
        tracker.log_params(run_id, flatten(sections))
        pipeline.write(dsd, tokenizer if cfg.model.name_or_path is None else None, stats)
        metrics = {**cost(), **describe.metrics(stats, raw.undecodable)}
        _log_data(tracker, run_id, cfg, dsd, stats, metrics, raw.source)
    rows = {s: st["rows"] for s, st in stats["splits"].items()}
    print(f"prepare: {stats['rows_read']} rows read ({fmt}), {pipeline.drop_summary(stats['rows_dropped'])}, "
          f"splits {rows}, {metrics['prepare_runtime']:.1f} s -> {paths.PROCESSED}")
    return stats


def _log_data(tracker, run_id: str, cfg: Config, dsd, stats: dict, metrics: dict, source: str) -> None:
    """The prepare run's metrics, fingerprint tag, stats artifact and one MLflow dataset input per split."""
    tracker.log_metrics(run_id, metrics)
    tracker.set_tags(run_id, {"data.fingerprint": stats["fingerprint"]})
    tracker.log_dict(run_id, stats, "stats.json")
    contexts = {"train": "training", "validation": "validation", "test": "test"}
    for df, name, context in describe.inputs(dsd, stats["format"], cfg.data.source, contexts):
        tracker.log_dataset(run_id, df, name=name, source=source, context=context, targets="label")


def _failure_note(error: BaseException) -> str:
    """Prepare's run description when it failed or was stopped (its outputs are written at the end: none kept)."""
    return failure_note(error, "Prepare", "Nothing half-written was kept; once the cause is fixed, `dvc repro` "
                                          "runs it again.")
