"""tests/cputime.py (the opt-in plugin that records each test's CPU time): its table sums the files' tests,
CPU (own + waited-for children) and wall seconds, the largest first, the rest in one row."""
from __future__ import annotations

import json

from tests import cputime


def test_the_table_sums_each_files_tests_by_cpu_time(tmp_path):
    lines = [{"id": "tests/unit/a.py::t1", "wall": 2.0, "self": 1.0, "children": 0.5},
             {"id": "tests/unit/a.py::t2", "wall": 1.0, "self": 0.5, "children": 0.0},
             {"id": "tests/integration/b.py::t", "wall": 9.0, "self": 0.1, "children": 3.9},
             {"id": "tests/unit/c.py::t", "wall": 0.5, "self": 0.2, "children": 0.0}]
    (tmp_path / "gw0-1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines[:2]))
    (tmp_path / "gw1-2.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines[2:]))
    rows = cputime.table(tmp_path, top=2).splitlines()[2:]
    assert rows == ["| `integration/b.py` | 1 | 4 | 9 |", "| `unit/a.py` | 2 | 2 | 3 |",
                    "| the other 1 files | 1 | 0 | 0 |", "| **all** | 4 | 6 | 12 |"]
