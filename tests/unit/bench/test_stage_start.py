"""bench/stage_start.py: how it reads ``-X importtime`` and sums a command's runs up; the timing itself is
the script's, not a test's."""
from __future__ import annotations

from bench import stage_start

IMPORTTIME = """import time: self [us] | cumulative | imported package
import time:       120 |        120 |   _io
import time:      2000 |       2000 |     torch._C
import time:    500000 |     502000 |   torch
import time:      1500 |       1500 |       transformers.utils.import_utils
import time:    250000 |     251500 |   transformers
some line the stage printed
import time:      3000 |       3000 | mlflow
"""


def test_each_modules_own_time_goes_to_its_top_level_package():
    got = stage_start.import_seconds(IMPORTTIME)
    assert got == {"_io": 0.00012, "torch": 0.502, "transformers": 0.2515, "mlflow": 0.003}


def test_a_row_is_the_median_of_the_runs_and_the_costliest_packages_first():
    by_command = {"train": {"runs": [{"cpu_s": c, "wall_s": w} for c, w in ((8.0, 9.0), (7.5, 8.0), (9.0, 9.5))],
                            "imports": {"torch": 0.85, "mlflow": 1.25, "peft": 1.5, "yaml": 0.01}}}
    assert stage_start.table_rows(by_command, "after") == [
        ["train", "after", "8.00", "9.00", "3.61", "peft 1.50, mlflow 1.25, torch 0.85, yaml 0.01"]]
