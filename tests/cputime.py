"""Where the suite's time goes: CPU time per test, beside its wall time (an opt-in pytest plugin).

``make test PYTEST_ARGS="-p tests.cputime" ONEGPU_TEST_CPUTIME=/tmp/cputime`` writes one JSON line per test
(``id``, ``wall``, ``self``: the worker's own user+system seconds, ``children``: those of the processes it
started and waited for: stages, `dvc`, torchrun) to ``<dir>/<worker>-<pid>.jsonl``; then
``python -m tests.cputime /tmp/cputime`` prints the files by CPU time as a Markdown table. On a machine
with fewer cores than workers the CPU time, not the wall time, is what a test costs the suite. Processes a
test leaves running on their own (DVC's queue workers, a tracking server) are not counted until waited for.
"""
from __future__ import annotations

import collections
import json
import os
import sys
import time
from pathlib import Path

import pytest

ENV = "ONEGPU_TEST_CPUTIME"


def _cpu() -> tuple[float, float]:
    t = os.times()
    return t.user + t.system, t.children_user + t.children_system


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    out = os.environ.get(ENV)
    (self0, kids0), w0 = _cpu(), time.monotonic()
    yield
    (self1, kids1), w1 = _cpu(), time.monotonic()
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        name = f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}-{os.getpid()}.jsonl"
        with open(Path(out) / name, "a") as f:
            f.write(json.dumps({"id": item.nodeid, "wall": round(w1 - w0, 3), "self": round(self1 - self0, 3),
                                "children": round(kids1 - kids0, 3)}) + "\n")


def table(folder: str | Path, top: int = 20) -> str:
    """The ``top`` test files by CPU seconds (the rest summed), with their tests and wall seconds."""
    by = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for path in Path(folder).glob("*.jsonl"):
        for line in path.read_text().splitlines():
            r = json.loads(line)
            b = by[r["id"].split("::")[0]]
            b[0], b[1], b[2] = b[0] + 1, b[1] + r["self"] + r["children"], b[2] + r["wall"]
    files = sorted(by.items(), key=lambda kv: -kv[1][1])
    rows = [f"| `{f.removeprefix('tests/')}` | {n} | {cpu:.0f} | {wall:.0f} |" for f, (n, cpu, wall) in files[:top]]
    rest = [b for _, b in files[top:]]
    if rest:
        rows.append(f"| the other {len(rest)} files | {sum(b[0] for b in rest)} | {sum(b[1] for b in rest):.0f} | "
                    f"{sum(b[2] for b in rest):.0f} |")
    rows.append(f"| **all** | {sum(b[0] for b in by.values())} | {sum(b[1] for b in by.values()):.0f} | "
                f"{sum(b[2] for b in by.values()):.0f} |")
    return "\n".join(["| test file | tests | CPU (s) | wall on its worker (s) |", "| --- | --- | --- | --- |", *rows])


if __name__ == "__main__":
    print(table(sys.argv[1]))
