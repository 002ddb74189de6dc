"""A benchmark's output: medians, and the printed Markdown with the machine line, written with every run's
numbers to ``bench/results/<name>[-tag].json`` and ``.md`` (:func:`report`)."""
from __future__ import annotations

import json
import statistics

from bench import machine
from bench.environment import BENCH

RESULTS = BENCH / "results"


def median(xs) -> float:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else float("nan")


def report(name: str, args, title: str, lines: list[str], payload: dict) -> None:
    """Print the Markdown (title, machine line, tables, notes) and write results/<name>[-tag].json/.md."""
    m = machine.describe()
    stem = f"{name}-{args.tag}" if getattr(args, "tag", "") else name
    md = "\n".join([f"### {title}", "", machine.line(m), "", *lines]).rstrip() + "\n"
    print("\n" + md)
    RESULTS.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": name, "machine": m, "args": vars(args), **payload}
    (RESULTS / f"{stem}.json").write_text(json.dumps(payload, indent=1, default=str) + "\n")
    (RESULTS / f"{stem}.md").write_text(md)
    print(f"wrote {RESULTS / (stem + '.json')} and .md")
