"""bench/tradeoffs_drift.py: the order of its windows and what it reads from their speeds; the windows
themselves are the script's (a real worker, minutes), not a test's."""
from __future__ import annotations

import pytest

from bench import tradeoffs_drift as drift


def test_the_baseline_runs_first_twice_and_after_every_row_or_in_the_given_order():
    assert drift.sequence(["bf16", "lora"]) == ["baseline", "baseline", "bf16", "baseline", "lora", "baseline"]
    assert drift.sequence(["bf16"], "B, bf16,B") == ["baseline", "bf16", "baseline"]


def test_the_summary_gives_the_baselines_spread_its_largest_step_and_the_change_across_each_row():
    names = ["baseline", "baseline", "bf16", "baseline", "lora", "baseline"]
    s = drift.summary(names, [10.0, 11.0, 99.0, 9.0, 50.0, 9.9])
    assert s["median"] == pytest.approx(9.95)
    assert s["spread"] == pytest.approx((9.0 / 9.95, 11.0 / 9.95))
    assert s["step_change"] == pytest.approx(9.0 / 11.0 - 1)  # the largest of +10%, -18.2%, +10%
    assert s["after_row"] == pytest.approx({"bf16": 9.0 / 11.0 - 1, "lora": 9.9 / 9.0 - 1})


def test_the_report_marks_only_baseline_windows_against_their_median_and_the_one_before():
    lines = drift.report_lines(["baseline", "bf16", "baseline"], [10.0, 20.0, 12.0])
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines[0].splitlines()[2:]]
    assert rows == [["1", "baseline", "10.00", "0.909x", ""], ["2", "bf16", "20.00", "", ""],
                    ["3", "baseline", "12.00", "1.091x", "+20.0%"]]
    assert "spread 0.909x-1.091x" in lines[-1] and "bf16 +20.0%" in lines[-1]
