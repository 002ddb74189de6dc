"""The ``onegpu`` command's garbage-collector settings (onegpu.interpreter) against CPython's defaults.

A small project (the packaged BBC News and MiniLM; ``--rows`` training rows of ``--max-length`` tokens,
``--steps`` optimizer steps of ``--micro`` x ``--accum``) in a temporary folder, whose stages run as the
pipeline runs them, each in a process of its own: ``python -m onegpu <stage>`` (the command: tuned at
start-up, CPython's defaults in the training loop) and the same ``main()`` without
``interpreter.start()`` (CPython's defaults throughout), the arms alternating, ``--reps`` times. Per
process: CPU time (user + system, from ``wait4``) and wall time; for train also train_loss (metrics/train.json),
which must be the same in every run, and train_samples_per_second (steps 2..N of a few steps: noisy).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

from bench import arms, environment, machine, reporting
from onegpu.formatting import markdown_table, ratio

ARMS = {"CPython's defaults": [sys.executable, "-c", "import sys; from onegpu.cli import main; sys.exit(main())"],
        "onegpu command": [sys.executable, "-m", "onegpu"]}
STAGES = ("prepare", "train", "evaluate")


def make_project(args) -> Path:
    """The temporary project root (``environment.setup``'s folder): params.yaml with the bench's sizes, links made."""
    root = environment.setup()
    params = yaml.safe_load((environment.REPO / "params.yaml").read_text())
    params["data"].update(max_train_samples=args.rows, max_eval_samples=32, max_length=args.max_length)
    params["train"].update(per_device_train_batch_size=args.micro, gradient_accumulation_steps=args.accum,
                           max_steps=args.steps, logging_steps=1, seed=args.seed)
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    subprocess.run([sys.executable, "-m", "onegpu", "inputs"], cwd=root, check=True, capture_output=True)
    return root


def timed_process(cmd: list[str], root: Path, env: dict | None = None) -> tuple[dict, str]:
    """``cmd`` in ``root`` as a process of its own (stdout discarded): ``({"cpu_s", "wall_s"}, its stderr)``,
    CPU seconds being user + system of it and its children (``wait4``), wall seconds from the start.

    Raises:
        RuntimeError: it exited non-zero (the message ends with its stderr's last 3,000 characters).
    """
    err = root / "tmp" / "stderr.txt"
    t0 = time.perf_counter()
    with open(err, "w") as f:
        p = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=f)
        _, status, usage = os.wait4(p.pid, 0)
    wall, text, rc = time.perf_counter() - t0, err.read_text(), os.waitstatus_to_exitcode(status)
    if rc != 0:
        raise RuntimeError(f"{' '.join(cmd[1:])} exited {rc}:\n{text[-3000:]}")
    return {"cpu_s": usage.ru_utime + usage.ru_stime, "wall_s": wall}, text


def one(root: Path, arm: str, stage: str) -> dict:
    """``stage`` in a process of its own under ``arm``: its CPU and wall seconds (and train's figures)."""
    res, _ = timed_process([*ARMS[arm], stage], root)
    if stage == "train":
        res.update(json.loads((root / "metrics" / "train.json").read_text()))
    return res


def measure(args, root: Path) -> dict:
    """``{stage: {arm: [results]}}``: per repetition every stage in pipeline order, each under both
    arms (the order rotating), each on a quiet machine (``machine.clean_run``)."""
    runs = {s: {a: [] for a in ARMS} for s in STAGES}
    for rep in range(args.reps):
        for stage in STAGES:
            for arm in arms.rotated(list(ARMS), rep):
                res = machine.clean_run(lambda arm=arm, stage=stage: one(root, arm, stage), args, f"{stage}, {arm}")
                runs[stage][arm].append(res)
                print(f"rep {rep + 1}/{args.reps} {stage:8s} {arm:18s} {res['cpu_s']:5.1f} s CPU "
                      f"{res['wall_s']:5.1f} s wall", flush=True)
    return runs


def report_lines(args, runs: dict) -> list[str]:
    """The table (one row per stage and arm) and the CPU ratios."""
    rows, notes = [], []
    for stage, by_arm in runs.items():
        for arm, results in by_arm.items():
            train = (f"{reporting.median(r['train_loss'] for r in results):.6f}",
                     f"{reporting.median(r['train_samples_per_second'] for r in results):.2f}") if stage == "train" \
                else ("", "")
            rows.append([stage, arm, ", ".join(f"{r['cpu_s']:.2f}" for r in results),
                         f"{reporting.median(r['cpu_s'] for r in results):.2f}",
                         f"{reporting.median(r['wall_s'] for r in results):.2f}", *train])
        base, tuned = (reporting.median(r["cpu_s"] for r in by_arm[a]) for a in ARMS)
        notes.append(f"- {stage}: the command's CPU time is **{ratio(tuned / base)}** CPython's defaults' "
                     f"({base - tuned:.1f} s less per process).")
    losses = {r["train_loss"] for arm in runs["train"].values() for r in arm}
    notes.append(f"- train_loss in every train run: {', '.join(f'{x:.6f}' for x in sorted(losses))} "
                 "(one value: the same training).")
    notes.append("- " + machine.load_note([r for by_arm in runs.values() for rs in by_arm.values() for r in rs]))
    head = ["stage", "arm", "CPU s per rep", "median CPU s", "median wall s", "train_loss", "samples/s"]
    desc = (f"`bench/interpreter.py`: {args.rows} training rows, max_length {args.max_length}, {args.micro} x "
            f"{args.accum}, {args.steps} optimizer steps; each stage a process of its own, {args.reps} repetitions "
            "(arm order rotating).")
    return [desc, "", markdown_table(head, rows), "", *notes]


def main() -> None:
    args = environment.parser(__doc__.splitlines()[0], reps=3, steps=3, rows=64, max_length=64, micro=4,
                         accum=2).parse_args()
    root = make_project(args)
    runs = measure(args, root)
    reporting.report("interpreter", args, "The onegpu command's garbage-collector settings against CPython's "
                  "defaults", report_lines(args, runs), {"runs": runs})


if __name__ == "__main__":
    main()
