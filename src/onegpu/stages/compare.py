"""``onegpu compare``: are runs with the same equivalence key the same training, and what does each cost?

Reads the training runs from the MLflow store (:mod:`onegpu.tracking`), compares them per optimizer step
(:mod:`onegpu.equivalence`), writes ``<out>/compare.md``, ``<out>/loss_curves.png`` and
``<out>/memory_vs_throughput.png`` (:mod:`onegpu.report`), prints a compact table, and logs the three
files as artifacts of a comparison run (tag ``stage=compare``).
"""
from __future__ import annotations

from pathlib import Path

from onegpu import equivalence, report, tracking
from onegpu.errors import UserError


def still_training(record: equivalence.RunRecord) -> bool:
    """RUNNING without the train-end summary (``train_runtime``): its training process is still writing
    steps, so comparing its curve now would report a spurious step-count difference. (A run that
    evaluate has re-opened is RUNNING too, but its training is complete: it is compared.)"""
    return record.status == "RUNNING" and "train_runtime" not in record.metrics


def run(experiment: str, key: str | None = None, run_ids: list[str] | None = None,
        exp_names: list[str] | None = None, out_dir: str | Path = "reports") -> equivalence.Comparison:
    """Compare the selected training runs of MLflow experiment ``experiment`` and report.

    Raises:
        UserError: no store or experiment, or no training run matches the filters.
    """
    tracker = tracking.open_existing(experiment)
    tracker.reap_orphans()  # a run whose training process died is KILLED, not "still training"
    records = [equivalence.RunRecord(**d) for d in tracking.training_runs(tracker, key, run_ids, exp_names)]
    training = [r for r in records if still_training(r)]
    for r in training:
        steps = max((s for s, _ in r.series.get("loss", [])), default=0)
        print(f"left out: MLflow run {r.name or r.run_id} ({r.run_id}) is still training ({steps} optimizer "
              "steps logged so far); compare again when it has finished")
    if training and len(training) == len(records):
        raise UserError(f"the {len(records)} matching training run(s) are all still training: nothing to "
                        "compare yet")
    records = [r for r in records if not still_training(r)]
    if not records:
        filters = [f"{name} {' '.join(v) if isinstance(v, list) else v}"
                   for name, v in (("--key", key), ("--runs", run_ids), ("--exp", exp_names)) if v]
        raise UserError(f"no training runs in MLflow experiment {experiment!r} "
                        f"({tracking.redact(tracker.uri)})"
                        + (f" matching {', '.join(filters)}" if filters else "")
                        + ": train first (`dvc repro`, `dvc exp run -S ...`)")
    # Runs outside the filters still count for overlaps in time (they shared the machine).
    others = [equivalence.RunRecord(**d) for d in tracking.training_run_windows(tracker)] \
        if (key or run_ids or exp_names) else []
    comparison = equivalence.compare(records, others)
    if not comparison.groups:
        raise UserError(f"none of the {len(records)} training runs has an equivalence_key tag "
                        "(runs from an older onegpu?): nothing to compare")
    store = tracking.redact(tracker.uri)
    files = report.write(comparison, out_dir, experiment=experiment, store=store)
    keys = [g.key for g in comparison.groups]
    ids = [r.run_id for g in comparison.groups for r in g.runs]
    counts = {"compare_runs": len(ids), "compare_groups": len(keys),
              "compare_equivalent": sum(g.count(equivalence.EQUIVALENT) for g in comparison.groups),
              "compare_diverged": sum(g.count(equivalence.DIVERGED) for g in comparison.groups)}
    compare_id = tracking.log_comparison(tracker, files, ids, keys, counts)
    print(report.terminal_table(comparison), end="")
    if comparison.skipped:
        print(f"({len(comparison.skipped)} training run(s) without an equivalence_key tag left out)")
    print(f"\nreport: {files[0]} (plots {files[1].name}, {files[2].name}); MLflow comparison run {compare_id}")
    return comparison
