"""Validation's cost on the default job: the whole pipeline (`dvc repro -f`: inputs, prepare, train,
evaluate) with the default validation (`train.eval_strategy: steps`, `train.eval_steps: 0.25`: four
points and the end) against the same with `train.eval_strategy: no`, in a temporary clone of this
repository's HEAD (its committed params.yaml), the arms alternating, each run after waiting for a quiet
machine.

Printed per arm: the pipeline's wall time (median of the runs), the train stage's `train_runtime` (the
steps alone: validation is kept out of it) and the validation points' summed `eval_runtime`, read back
from the run's MLflow store. Target (issue 41): validation adds at most 10% to the default job's wall.
"""
from __future__ import annotations

import argparse
import os
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import machine, reporting
from bench.environment import REPO
from onegpu.formatting import markdown_table

TARGET = 1.10
ARMS = {"validation": [], "no validation": ["-S", "train.eval_strategy=no"]}


def run_figures(db: Path) -> dict:
    """The newest training run's ``train_runtime`` and its validation points (count, summed ``eval_runtime``)
    in the MLflow SQLite store ``db`` (read directly: no MLflow import in the timed process's parent)."""
    con = sqlite3.connect(db)
    try:
        run = con.execute("SELECT r.run_uuid FROM runs r JOIN tags t ON t.run_uuid = r.run_uuid WHERE "
                          "t.key = 'stage' AND t.value = 'train' ORDER BY r.start_time DESC LIMIT 1").fetchone()[0]
        runtime = con.execute("SELECT value FROM latest_metrics WHERE run_uuid = ? AND key = 'train_runtime'",
                              (run,)).fetchone()
        evals = con.execute("SELECT COUNT(*), COALESCE(SUM(value), 0) FROM metrics WHERE run_uuid = ? AND "
                            "key = 'eval_runtime'", (run,)).fetchone()
    finally:
        con.close()
    return {"train_runtime_s": runtime[0] if runtime else None, "points": evals[0], "eval_runtime_s": evals[1]}


def timed(project: Path, args: list[str]) -> dict:
    """``dvc repro -f`` in ``project`` with ``args`` (``-S`` as `dvc exp run` takes them, applied to
    params.yaml for this run and restored after): wall time, other load, the run's figures."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "DVC_"))}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    params = (project / "params.yaml").read_text()
    if args:
        key, value = args[1].split("=", 1)
        section, name = key.split(".")
        (project / "params.yaml").write_text(params.replace(f"  {name}: steps", f"  {name}: {value}", 1))
    waited = machine.wait_quiet(300)
    try:
        with machine.OtherLoad() as load:
            t0 = time.perf_counter()
            p = subprocess.run(["dvc", "repro", "-f"], cwd=project, env=env, capture_output=True, text=True)
            wall = time.perf_counter() - t0
    finally:
        (project / "params.yaml").write_text(params)
    if p.returncode != 0:
        raise SystemExit(f"dvc repro -f exited {p.returncode}:\n{p.stdout[-3000:]}{p.stderr[-3000:]}")
    return {"args": args, "wall_s": round(wall, 1), "other_load_cores": round(load.cores, 2),
            "waited_s": round(waited, 1), **run_figures(project / "mlflow.db")}


def summary(results: list[dict]) -> tuple[list[list[str]], float]:
    """The table's rows (one per arm: medians) and the ratio of the arms' median walls (validation / none)."""
    rows, walls = [], {}
    for name, args in ARMS.items():
        mine = [r for r in results if r["args"] == args]
        walls[name] = reporting.median(r["wall_s"] for r in mine)
        rows.append([name, str(len(mine)), f"{walls[name]:.1f}",
                     f"{reporting.median(r['train_runtime_s'] for r in mine):.1f}",
                     f"{reporting.median(r['points'] for r in mine):.0f}",
                     f"{reporting.median(r['eval_runtime_s'] for r in mine):.2f}",
                     f"{max(r['other_load_cores'] for r in mine):.2f}"])
    return rows, walls["validation"] / walls["no validation"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3, help="runs of each arm, alternating")
    p.add_argument("--tag", default="", help="suffix for the result files: results/validation-<tag>.json")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="onegpu-bench-validation-") as tmp:
        project = Path(tmp) / "project"
        subprocess.run(["git", "clone", "-q", str(REPO), str(project)], check=True)
        results = []
        for i in range(args.runs):
            for name in (list(ARMS) if i % 2 == 0 else list(ARMS)[::-1]):
                results.append(timed(project, ARMS[name]))
    rows, ratio = summary(results)
    lines = [markdown_table(["arm", "runs", "pipeline wall (s, median)", "train_runtime (s)", "validation points",
                             "eval_runtime summed (s)", "other load (cores, max)"], rows), "",
             f"Validation adds {ratio - 1:+.1%} to the default job's wall (target <= {TARGET - 1:.0%})."]
    reporting.report("validation", args, "Validation while training: its cost on the default job", lines,
                     {"results": results, "ratio": ratio})


if __name__ == "__main__":
    main()
