"""``onegpu prepare``: read, de-duplicate, split, tokenize -> data/processed/ and data/stats.json.

Logs a run of its own (tag ``stage=prepare``): ``prepare_runtime`` (s), ``prepare_rows_per_second``
(rows read / runtime), ``prepare_mem_peak_bytes`` (process RSS peak), ``rows_read``, ``rows_kept`` and
``rows_dropped_<reason>`` per reason in ``data.DROP_REASONS``, the stats (artifact ``stats.json``), and
each split as an MLflow dataset input.
"""
from __future__ import annotations

from onegpu import data, measure, models, paths, tracking
from onegpu.config import Config, flatten
from onegpu.errors import DataError


def _log_cost(tracker, run_id: str, metrics: dict) -> dict:
    try:
        tracker.log_metrics(run_id, metrics)
    except Exception:
        pass  # the store failed too: the error being reported matters more
    return {}


def drop_summary(dropped: dict[str, int]) -> str:
    """``"3 dropped (empty text 1, empty label 1, duplicate 1)"``, or ``"0 dropped"``."""
    parts = [f"{r.replace('_', ' ')} {n}" for r, n in dropped.items() if n]
    return f"{sum(dropped.values())} dropped" + (f" ({', '.join(parts)})" if parts else "")


def run(cfg: Config) -> dict:
    watch = measure.Stopwatch()
    from datasets.utils.logging import disable_progress_bar
    disable_progress_bar()
    data.check_source(cfg.data)  # a missing file or model fails before any work, and before a run exists
    models.resolve_model_path(cfg.model.name_or_path)
    tracker = tracking.connect(cfg.tracking.experiment_name)
    run_id = tracker.start_run(tracking.run_name(), {**tracking.run_context_tags(), "stage": "prepare"})
    rows_read = {"n": 0}

    def cost() -> dict:
        """The contract's three prepare figures, logged on failure too: the attempt was measured."""
        runtime = watch.total()
        return {"prepare_runtime": runtime, "prepare_rows_per_second": rows_read["n"] / runtime,
                "prepare_mem_peak_bytes": measure.rss_peak_bytes()}

    with tracker.guard(run_id, context=lambda: _log_cost(tracker, run_id, cost())):
        sections = {k: v for k, v in cfg.to_dict().items() if k in ("data", "model", "tracking")}
        tracker.log_params(run_id, flatten(sections))

        task = cfg.model.task
        raw = data.read(cfg.data, task)
        rows_read["n"] = len(raw.texts)
        texts, labels, dropped = data.deduplicate(raw)
        if not texts:
            raise DataError(f"data.source={cfg.data.source!r}: no row has a non-blank text in data.text_column="
                            f"{cfg.data.text_column!r} and a label in data.label_column={cfg.data.label_column!r} "
                            f"({len(raw.texts)} rows read, {drop_summary(dropped)})")
        dsd = data.split(texts, labels, cfg.data, task)
        if cfg.model.name_or_path is None:  # causal-lm from config: a BPE tokenizer of our own
            tokenizer = models.train_bpe_tokenizer(dsd["train"]["text"], cfg.model.vocab_size)
        else:
            tokenizer = models.load_tokenizer(models.resolve_model_path(cfg.model.name_or_path), task)
        dsd = data.tokenize(dsd, tokenizer, cfg.data.max_length, task)
        stats = data.stats(dsd, rows_read=len(raw.texts), dropped=dropped, undecodable=raw.undecodable,
                           max_length=cfg.data.max_length)

        _write(dsd, tokenizer if cfg.model.name_or_path is None else None, stats)
        metrics = {**cost(), **_data_metrics(stats, dropped, raw.undecodable)}
        _log_data(tracker, run_id, cfg, dsd, stats, metrics, raw.source)
    rows = {s: st["rows"] for s, st in stats["splits"].items()}
    print(f"prepare: {stats['rows_read']} rows read, {drop_summary(dropped)}, splits {rows}, "
          f"{metrics['prepare_runtime']:.1f} s -> {paths.PROCESSED}")
    return stats


def _write(dsd, own_tokenizer, stats: dict) -> None:
    """data/processed (with the tokenizer prepare trained, if any) and data/stats.json, each atomically:
    no half-written output for DVC to cache."""
    with paths.atomic_dir(paths.PROCESSED) as tmp:
        dsd.save_to_disk(str(tmp))
        if own_tokenizer is not None:
            own_tokenizer.save_pretrained(str(tmp / paths.TOKENIZER.name))
    paths.write_json_atomic(paths.STATS, stats)


def _data_metrics(stats: dict, dropped: dict[str, int], undecodable: int) -> dict:
    """Row counts, drops by reason and per-split sizes, tokens, length percentiles and truncated share."""
    metrics = {"rows_read": stats["rows_read"], "rows_kept": stats["rows_kept"],
               **{f"rows_dropped_{r}": n for r, n in dropped.items()},
               "duplicates_removed": dropped["duplicate"], "undecodable_files": undecodable}
    for s, st in stats["splits"].items():
        metrics.update({f"rows_{s}": st["rows"], f"tokens_{s}": st["tokens"],
                        f"length_p50_{s}": st["length_p50"], f"length_p90_{s}": st["length_p90"],
                        f"truncated_share_{s}": st["truncated_share"]})
    return metrics


def _log_data(tracker, run_id: str, cfg: Config, dsd, stats: dict, metrics: dict, source: str) -> None:
    """The prepare run's metrics, fingerprint tag, stats artifact and one MLflow dataset input per split."""
    tracker.log_metrics(run_id, metrics)
    tracker.set_tags(run_id, {"data.fingerprint": stats["fingerprint"]})
    tracker.log_dict(run_id, stats, "stats.json")
    names = stats["labels"]
    for s in data.SPLITS:
        df = dsd[s].select_columns(["text", "label"]).to_pandas()
        df["label"] = df["label"].map(lambda i: names[i])
        tracker.log_dataset(run_id, df, name=f"{cfg.data.source}-{s}", source=source,
                            context={"train": "training", "validation": "validation", "test": "test"}[s],
                            targets="label")
