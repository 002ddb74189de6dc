"""``onegpu tradeoffs``: the single-GPU guide's table, measured on the user's own model and data.

Runs the baseline (the user's params) and one row per knob (:mod:`onegpu.tradeoffs.knobs`) one at a time
(speed is only comparable without other load), each for a probe window of ``steps`` optimizer steps in
worker processes on data prepared once (:mod:`onegpu.tradeoffs.pool`), or for the whole job (None) as
``dvc exp run --temp``, ``repeats`` times in interleaved rounds; reads their MLflow runs, and when
several knobs were clearly faster without changing the training, runs their combination too
(:mod:`onegpu.tradeoffs.batch`). Writes ``<out>/tradeoffs.md`` and ``<out>/tradeoffs.png``
(:mod:`onegpu.tradeoffs.report`), logs both to an MLflow run (tag ``stage=tradeoffs``) and prints the
table. Ctrl-C stops the row running, reports what was measured (incomplete) and ends with exit code 130.
"""
from __future__ import annotations

from pathlib import Path

from onegpu import compare, tracking
from onegpu.config import Config
from onegpu.errors import UserError
from onegpu.measure import memory
from onegpu.tradeoffs import batch as batches, pool as workers, queue, report
from onegpu.tradeoffs.knobs import KNOBS
from onegpu.tradeoffs.measurement import Row


def run(cfg: Config, params: str = "params.yaml", knobs: tuple[str, ...] = tuple(KNOBS),
        queue_only: bool = False, report_only: bool = False, batch: str | None = None,
        combine: bool = True, out_dir: str | Path = "reports", overrides: list[str] = (),
        steps: int | None = batches.PROBE_STEPS, repeats: int = batches.REPEATS) -> list[Row]:
    """Queue, run and report (see the module docstring); ``cfg`` is the params file with ``overrides``
    (``-S key=value``, applied to every experiment, the baseline too) applied; ``queue_only``: queue and stop;
    ``report_only``: report on ``batch`` (default: the latest) without queueing or running anything;
    ``combine``: run the combined recommendation when it needs its own run; ``steps``: optimizer steps
    per row (None: the whole job, evaluate too); ``repeats``: runs of each row.

    Returns:
        The measured rows (baseline first; the combined recommendation last when it ran).
    Raises:
        UserError: not in a DVC project, other experiments queued (they would run too and share the
            machine), a row whose params do not validate, dvc failing to queue, no MLflow store or runs.
        KeyboardInterrupt: Ctrl-C or SIGTERM stopped the batch (after its report).
    """
    if not Path("dvc.yaml").is_file():
        raise UserError("no dvc.yaml here: run onegpu tradeoffs from the project root")
    facts, interrupted = memory.device_facts(), False
    with workers.for_batch(cfg, params, facts, steps, queue_only or report_only) as pool:  # probe rows' workers
        if not report_only:
            batch, interrupted = batches.start(cfg, params, knobs, list(overrides), queue_only, facts, steps,
                                               repeats, pool)
            if queue_only:
                return []
        manifest = batches.load_plan(batch)
        batch, prefix = manifest["batch"], batches.prefix(manifest["batch"])
        tracker = tracking.open_existing(cfg.tracking.experiment_name)
        tracker.reap_orphans()

        def fetch() -> dict[str, compare.RunRecord]:
            records = [compare.RunRecord(**d) for d in tracking.training_runs_named(tracker, prefix)]
            return batches.finished_runs(records, prefix)
        result = batches.measure(manifest, fetch, batches.budget_bytes(cfg, facts), combine, report_only,
                                 f"MLflow experiment {cfg.tracking.experiment_name!r}",
                                 queue.states() if report_only else {}, interrupted, pool)
    manifest = batches.load_plan(batch)  # with the wall times of the rows just run
    title = f"onegpu tradeoffs {batch}" + "".join(f" -S {o}" for o in manifest.get("overrides", []))
    files = report.write(result.rows, result.recommendation, result.measured, out_dir, title,
                         manifest.get("skipped", []), report.window_text(manifest), batches.timing(manifest, fetch()))
    shown = result.rows + report.combined_row(result.measured)
    run_id = tracking.log_comparison(tracker, files, [r.run.run_id for r in shown if r.run],
                                     sorted({r.run.key for r in shown if r.run and r.run.key}),
                                     report.ratios(result.rows, result.measured), stage="tradeoffs",
                                     name=f"{batches.PREFIX}{batch}")
    print()
    print(report.terminal(result.rows, result.recommendation, result.measured), end="")
    print(f"\nreport: {files[0]} (plot {files[1].name}); MLflow run {run_id} ({batches.PREFIX}{batch})")
    if result.interrupted:
        done = sum(1 for r in result.rows if r.run is not None)
        print(f"onegpu tradeoffs: stopped (Ctrl-C or SIGTERM): {done} of {len(result.rows)} rows measured (the report "
              "above says which); nothing of this batch is left queued or running", flush=True)
        raise KeyboardInterrupt()
    return result.rows + ([result.measured] if result.combined else [])
