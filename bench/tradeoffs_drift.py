"""Why `onegpu tradeoffs`' baseline spreads: the baseline between every row, in one worker.

In a temporary clone of this repository's HEAD (its committed params.yaml: the default job), one probe
worker (:mod:`onegpu.tradeoffs.pool`, as the command runs its rows) trains the baseline, then each row of
the plan followed by the baseline again (``B B r1 B r2 B ...``; ``--sequence`` gives another order), each for
the command's window of optimizer steps. Per window: its steady samples/s (steps 2..N, as the report
measures a row), and for each baseline window its ratio to the baseline's median and to the baseline
window before it. A row that leaves the worker slower (compiled code, an allocator's state, an imported
library) shows as a step down in the baseline right after it; a machine whose speed drifts shows as
neighbouring baseline windows that agree while distant ones differ.

Target (bench/tradeoffs_time.py's): the baseline's spread within +-10%.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

from bench import machine, reporting
from bench.environment import REPO
from onegpu.formatting import markdown_table

BASELINE = "baseline"
PREFIX = "drift-"  # the windows' MLflow run names: drift-<nn>-<row>


def sequence(rows: list[str], explicit: str | None = None) -> list[str]:
    """The windows' row names: ``baseline, baseline`` then each of ``rows`` followed by the baseline; or
    ``explicit`` (comma-separated, ``B`` for the baseline)."""
    if explicit:
        return [BASELINE if n.strip() == "B" else n.strip() for n in explicit.split(",") if n.strip()]
    out = [BASELINE, BASELINE]
    for r in rows:
        out += [r, BASELINE]
    return out


def summary(names: list[str], speeds: list[float]) -> dict:
    """The baseline windows' speeds (samples/s) against their median: ``spread`` (min, max), the largest
    change from one baseline window to the next (``step_change``, relative) and, per row, the change of the
    baseline window after it against the one before (``after_row``: row name -> relative change)."""
    base = [(i, s) for i, (n, s) in enumerate(zip(names, speeds)) if n == BASELINE]
    med = statistics.median(s for _, s in base)
    changes = [b / a - 1 for (_, a), (_, b) in zip(base, base[1:])]
    after = {}
    for i, n in enumerate(names):
        before = [s for j, s in base if j < i]
        later = [s for j, s in base if j > i]
        if n != BASELINE and before and later:
            after[n] = later[0] / before[-1] - 1
    return {"median": med, "spread": (min(s for _, s in base) / med, max(s for _, s in base) / med),
            "step_change": max(changes, key=abs) if changes else 0.0, "after_row": after}


def _measure(project: Path, explicit: str | None) -> tuple[list[str], list[float]]:
    """The windows, trained in ``project`` (the current directory during the call) by one worker."""
    here = os.getcwd()
    os.chdir(project)
    try:
        return _windows(explicit)
    finally:
        os.chdir(here)


def _windows(explicit: str | None) -> tuple[list[str], list[float]]:
    from onegpu import compare, tracking
    from onegpu.config import load
    from onegpu.measure import memory
    from onegpu.tradeoffs import batch, knobs, pool
    from onegpu.tradeoffs.measurement import steady_samples_per_second
    cfg, facts = load("params.yaml"), memory.device_facts()
    variants = {v.name: v for v in knobs.plan(cfg, facts)[0]}
    rows = [n for n, v in variants.items() if n != BASELINE and v.knob != "allocator"]  # its own worker
    names = sequence(rows, explicit)
    windows = [f"{i:02d}-{n}" for i, n in enumerate(names)]
    with pool.for_batch(cfg, "params.yaml", facts, batch.PROBE_STEPS, False) as workers:
        for window, n in zip(windows, names):
            workers.train(PREFIX + window, [*batch.window(batch.PROBE_STEPS), *variants[n].assignments])
    # read back as onegpu tradeoffs reads its rows: the runs by name, each one's steady samples/s (steps 2..N)
    runs = batch.finished_runs([compare.RunRecord(**d) for d in tracking.training_runs_named(
        tracking.open_existing(cfg.tracking.experiment_name), PREFIX)], PREFIX)
    return names, [steady_samples_per_second(runs[w]) for w in windows]


def report_lines(names: list[str], speeds: list[float]) -> list[str]:
    s = summary(names, speeds)
    prev, table = None, []
    for i, (n, v) in enumerate(zip(names, speeds)):
        is_base = n == BASELINE
        table.append([str(i + 1), n, f"{v:.2f}", f"{v / s['median']:.3f}x" if is_base else "",
                      f"{v / prev - 1:+.1%}" if is_base and prev else ""])
        prev = v if is_base else prev
    after = ", ".join(f"{n} {c:+.1%}" for n, c in s["after_row"].items())
    return [markdown_table(["window", "row", "samples/s (steps 2..N)", "baseline vs its median",
                            "baseline vs the baseline before"], table), "",
            f"Baseline: {sum(n == BASELINE for n in names)} windows, spread {s['spread'][0]:.3f}x-"
            f"{s['spread'][1]:.3f}x of its median (target within +-10%); largest change between two baseline "
            f"windows in a row {s['step_change']:+.1%}. The baseline after each row against the one before "
            f"it: {after}."]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sequence", help="comma-separated rows, B for the baseline (default: B B r1 B r2 B ...)")
    p.add_argument("--tag", default="", help="suffix for the result files: results/tradeoffs_drift-<tag>.json")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="onegpu-bench-drift-") as tmp:
        project = Path(tmp) / "project"
        subprocess.run(["git", "clone", "-q", str(REPO), str(project)], check=True)
        machine.wait_quiet(300)
        with machine.OtherLoad() as load:
            names, speeds = _measure(project, args.sequence)
    lines = [*report_lines(names, speeds), "", f"Other load during the windows: {load.cores:.2f} cores."]
    reporting.report("tradeoffs_drift", args, "onegpu tradeoffs: the baseline between every row", lines,
                     {"names": names, "samples_per_second": speeds, "summary": summary(names, speeds),
                      "other_load_cores": load.cores})


if __name__ == "__main__":
    main()
