"""A stage process's start: what an ``onegpu`` command costs before its work, by command and by package.

A small project (the packaged BBC News and MiniLM; ``--rows`` training rows of ``--max-length`` tokens,
``--steps`` optimizer steps of ``--micro`` x ``--accum``) in a temporary folder, whose commands run in
pipeline order, each in a process of its own (``python -m onegpu <command>``), ``--reps`` times. Per process:
CPU seconds (user + system of the process and its children, from ``wait4``) and wall seconds. Once more per
command under ``python -X importtime``: the seconds its imports took (the sum of every module's own time, in
the one thread that imports), by top-level package. A stage's imports are the start before its work: the
stages import what they use up front and then work.

``--before SRC`` runs every command a second time with ``PYTHONPATH=SRC`` (an older checkout's ``src``), the
arms alternating, so that one sitting on one machine gives both.
"""
from __future__ import annotations

import os
import re
import sys
from collections import defaultdict
from pathlib import Path

from bench import arms, environment, interpreter, machine, reporting
from onegpu.formatting import markdown_table

COMMANDS = (("prepare",), ("train",), ("evaluate",), ("compare",), ("summary",), ("--help",))
TOP_PACKAGES = 6  # packages named per command; the rest is "other"
_LINE = re.compile(r"^import time:\s+(\d+)\s+\|\s+(\d+)\s+\|\s*(\S+)")


def import_seconds(stderr: str) -> dict[str, float]:
    """``{top-level package: seconds}`` from ``-X importtime`` lines (``import time: self [us] | cumulative
    [us] | name``, a nested module indented): each module's own time added to its top-level package's."""
    by = defaultdict(float)
    for line in stderr.splitlines():
        m = _LINE.match(line)
        if m:
            by[m.group(3).lstrip(".").split(".")[0]] += int(m.group(1)) / 1e6
    return dict(by)


def _env(src: str | None) -> dict:
    env = dict(os.environ)
    if src:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    return env


def one(root: Path, command: tuple[str, ...], src: str | None, importtime: bool = False) -> dict:
    """``command`` in a process of its own (``src`` first on its path): CPU and wall seconds, and with
    ``importtime`` its import seconds by package. RuntimeError with its stderr if it fails."""
    cmd = [sys.executable, *(["-X", "importtime"] if importtime else []), "-m", "onegpu", *command]
    res, stderr = interpreter.timed_process(cmd, root, _env(src))
    if importtime:
        res["imports"] = import_seconds(stderr)
    return res


def measure(args, root: Path) -> dict:
    """``{arm: {command: {"runs": [...], "imports": {...}}}}``: per repetition every command in order under
    every arm (the order rotating), on a quiet machine (``machine.clean_run``); the import run last."""
    srcs = {"after": None, **({"before": args.before} if args.before else {})}
    out = {arm: {" ".join(c): {"runs": []} for c in COMMANDS} for arm in srcs}
    for rep in range(args.reps + 1):
        for command in COMMANDS:
            name = " ".join(command)
            for arm in arms.rotated(list(srcs), rep):
                timed = rep == args.reps  # the last pass is -X importtime's
                res = machine.clean_run(lambda a=arm, c=command, t=timed: one(root, c, srcs[a], t), args, name)
                if timed:
                    out[arm][name]["imports"] = res["imports"]
                else:
                    out[arm][name]["runs"].append(res)
                print(f"rep {rep + 1}/{args.reps + 1} {name:9s} {arm:6s} {res['cpu_s']:5.2f} s CPU "
                      f"{res['wall_s']:5.2f} s wall{' (-X importtime)' if timed else ''}", flush=True)
    return out


def table_rows(by_command: dict, arm: str) -> list[list[str]]:
    """One row per command: median CPU and wall, import seconds, and the packages that cost most."""
    rows = []
    for name, got in by_command.items():
        imports = got.get("imports", {})
        top = sorted(imports.items(), key=lambda kv: -kv[1])[:TOP_PACKAGES]
        rows.append([name, arm, f"{reporting.median(r['cpu_s'] for r in got['runs']):.2f}",
                     f"{reporting.median(r['wall_s'] for r in got['runs']):.2f}", f"{sum(imports.values()):.2f}",
                     ", ".join(f"{k} {v:.2f}" for k, v in top)])
    return rows


def report_lines(args, out: dict) -> list[str]:
    """The table (command x arm) and the notes."""
    rows = [row for arm, by_command in out.items() for row in table_rows(by_command, arm)]
    rows.sort(key=lambda r: ([" ".join(c) for c in COMMANDS].index(r[0]), r[1] != "before"))
    head = ["command", "arm", "median CPU s", "median wall s", "import s (-X importtime)", "import s by package"]
    desc = (f"`bench/stage_start.py`: {args.rows} training rows, max_length {args.max_length}, {args.micro} x "
            f"{args.accum}, {args.steps} optimizer steps; each command a process of its own, {args.reps} "
            "repetitions, then one under `-X importtime` (its import seconds: every module's own time, "
            "which adds that option's own overhead)." + (f" before: PYTHONPATH={args.before}." if args.before else ""))
    runs = [r for by in out.values() for got in by.values() for r in got["runs"]]
    return [desc, "", markdown_table(head, rows), "", "- " + machine.load_note(runs)]


def main() -> None:
    p = environment.parser(__doc__.splitlines()[0], reps=3, steps=3, rows=64, max_length=64, micro=4, accum=2)
    p.add_argument("--before", default="", help="an older checkout's src folder, measured beside this one")
    args = p.parse_args()
    root = interpreter.make_project(args)
    out = measure(args, root)
    reporting.report("stage_start", args, "A stage process's start", report_lines(args, out), {"arms": out})


if __name__ == "__main__":
    main()
