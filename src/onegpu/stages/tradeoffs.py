"""``onegpu tradeoffs``: the single-GPU guide's table, measured on the user's own model and data.

The baseline (the user's params) and a row per knob (:mod:`onegpu.tradeoffs.knobs`) run one at a time, in
interleaved rounds (a row again only while its next window can change the answer: :mod:`.windows`), for
``steps`` optimizer steps in worker processes (:mod:`onegpu.tradeoffs.pool`) or the whole job (None) as ``dvc
exp run --temp``, then the combination of the knobs clearly faster with the same training (:mod:`.batch`).
Writes ``<out>/tradeoffs.md`` and ``.png``, logs both to an MLflow run (tag ``stage=tradeoffs``), prints the
table. Ctrl-C stops the row running, reports what was measured, exits 130."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

from onegpu import compare, tracking
from onegpu.config import Config
from onegpu.errors import UserError
from onegpu.measure import memory
from onegpu.tradeoffs import batch as batches, pool as workers, queue, report
from onegpu.tradeoffs.measurement import Row


@dataclass(frozen=True)
class Request:
    """One ``onegpu tradeoffs`` (the command line's arguments; ``cli`` builds it)."""
    cfg: Config                      # the params file with ``overrides`` applied
    params: str = "params.yaml"
    knobs: tuple[str, ...] | None = None  # the rows: names of knobs.KNOBS; None: knobs.plan's default set
    queue_only: bool = False         # queue the rows and stop
    report_only: bool = False        # report on ``batch`` (None: the latest); queue and run nothing
    batch: str | None = None
    combine: bool = True             # run the combined recommendation when it needs its own run
    out_dir: str | Path = "reports"
    overrides: tuple[str, ...] = ()  # ``-S key=value`` for every experiment, the baseline too
    steps: int | None = batches.PROBE_STEPS  # optimizer steps per row; None: the whole job, evaluate too
    repeats: int | None = None       # runs of every row in interleaved rounds; None: up to batches.REPEATS, adaptive


def run(req: Request) -> list[Row]:
    """Queue, run and report (the module docstring): the rows, the baseline first, the combination last when it
    ran. Raises UserError (not in a DVC project, experiments queued, a row's params invalid, dvc failing to
    queue, no MLflow store or runs); KeyboardInterrupt after a stopped batch's report."""
    if not Path("dvc.yaml").is_file():
        raise UserError("no dvc.yaml here: run onegpu tradeoffs from the project root")
    cfg, batch, facts, interrupted, queue_only = req.cfg, req.batch, memory.device_facts(), False, req.queue_only

    def runs_named(prefix: str) -> dict[str, compare.RunRecord]:  # the rows' runs so far, by row name
        return batches.finished_runs([compare.RunRecord(**d) for d in tracking.training_runs_named(
            tracking.open_existing(cfg.tracking.experiment_name), prefix)], prefix)
    with workers.for_batch(cfg, req.params, facts, req.steps, queue_only or req.report_only, req.overrides) as pool:
        if not req.report_only:
            batch, interrupted = batches.start(cfg, req.params, req.knobs, list(req.overrides), req.queue_only,
                                               facts, req.steps, req.repeats, pool, runs_named)
            if req.queue_only:
                return []
        manifest = batches.load_plan(batch)
        batch, fetch = manifest["batch"], functools.partial(runs_named, batches.prefix(manifest["batch"]))
        tracker = tracking.open_existing(cfg.tracking.experiment_name)
        tracker.reap_orphans()
        result = batches.measure(manifest, fetch, batches.budget_bytes(cfg, facts), req.combine, req.report_only,
                                 f"MLflow experiment {cfg.tracking.experiment_name!r}",
                                 queue.states() if req.report_only else {}, interrupted, pool)
    manifest = batches.load_plan(batch)  # with the wall times of the rows just run
    files = report.write(result.rows, result.recommendation, result.measured, req.out_dir,
                         f"onegpu tradeoffs {batch}" + "".join(f" -S {o}" for o in manifest.get("overrides", [])),
                         manifest.get("skipped", []), report.window_text(manifest), batches.timing(manifest, fetch()))
    shown = result.rows + report.combined_row(result.measured)
    run_id = tracking.log_comparison(tracker, files, [r.run.run_id for r in shown if r.run],
                                     sorted({r.run.key for r in shown if r.run and r.run.key}),
                                     report.ratios(result.rows, result.measured), stage="tradeoffs",
                                     name=f"{batches.PREFIX}{batch}")
    print("\n" + report.terminal(result.rows, result.recommendation, result.measured)
          + f"\nreport: {files[0]} (plot {files[1].name}); MLflow run {run_id} ({batches.PREFIX}{batch})")
    if result.interrupted:
        print(f"onegpu tradeoffs: stopped (Ctrl-C or SIGTERM): {sum(1 for r in result.rows if r.run is not None)} of "
              f"{len(result.rows)} rows measured (the report above says which); nothing of this batch is left "
              "queued or running", flush=True)
        raise KeyboardInterrupt()
    return result.rows + ([result.measured] if result.combined else [])
