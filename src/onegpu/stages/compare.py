"""``onegpu compare``: are runs with the same equivalence key the same training, and what does each cost?

Reads the training runs from the MLflow store (:mod:`onegpu.tracking`), compares them per optimizer step
(:mod:`onegpu.compare`), writes ``<out>/compare.md``, ``<out>/loss_curves.png`` and
``<out>/memory_vs_throughput.png`` (:mod:`onegpu.compare.report`), prints a compact table, and logs the
three files as artifacts of a comparison run (tag ``stage=compare``).
"""
from __future__ import annotations

from pathlib import Path

from onegpu import compare, tracking
from onegpu.compare import report
from onegpu.errors import UserError


def run(experiment: str, key: str | None = None, run_ids: list[str] | None = None,
        exp_names: list[str] | None = None, out_dir: str | Path = "reports") -> compare.Comparison:
    """Compare the selected training runs of MLflow experiment ``experiment`` and report.

    Raises:
        UserError: no store or experiment, or no training run matches the filters.
    """
    tracker = tracking.open_existing(experiment)
    tracker.reap_orphans()  # a run whose training process died is KILLED, not "still training"
    store = tracking.redact(tracker.uri)
    filters = {"--key": key, "--runs": run_ids, "--exp": exp_names}
    records = compare.finished_training(
        [compare.RunRecord(**d) for d in tracking.training_runs(tracker, key, run_ids, exp_names)],
        f"MLflow experiment {experiment!r} ({store})", filters)
    # Runs outside the filters still count for overlaps in time (they shared the machine).
    others = [compare.RunRecord(**d) for d in tracking.training_run_windows(tracker)] \
        if any(filters.values()) else []
    comparison = compare.compare(records, others, named=bool(run_ids or exp_names))
    if not comparison.groups:
        raise UserError(f"none of the {len(records)} training runs has an equivalence_key tag "
                        "(runs from an older onegpu?): nothing to compare")
    files = report.write(comparison, out_dir, experiment=experiment, store=store)
    compare_id = tracking.log_comparison(tracker, files, comparison.run_ids, comparison.keys, comparison.counts())
    print(report.terminal_table(comparison), end="")
    if comparison.skipped:
        print(f"({len(comparison.skipped)} training run(s) without an equivalence_key tag left out)")
    if comparison.continued:
        print(report.continued_line(comparison))
    print(f"\nreport: {files[0]} (plots {files[1].name}, {files[2].name}); MLflow comparison run {compare_id}")
    return comparison
