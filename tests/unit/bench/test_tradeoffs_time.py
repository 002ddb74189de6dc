"""bench/tradeoffs_time.py: what it reads from a finished batch (the baseline's spread in the report, the
windows its plan kept); the timing itself is the script's, not a test's."""
from __future__ import annotations

import pytest

from bench import tradeoffs_time

REPORT = """| row | change | vs baseline (median) | min-max of repeats | verdict |
|-----|--------|----------------------|--------------------|---------|
| baseline | your params.yaml | 1.00x | 0.97x-1.05x | baseline |
| split-16x1 | micro-batch 16 | 1.08x | 1.04x-1.12x | same training |
"""


def test_the_baseline_spread_is_its_rows_min_max_and_none_with_one_window():
    assert tradeoffs_time.baseline_spread(REPORT) == (0.97, 1.05)
    assert tradeoffs_time.baseline_spread(REPORT.replace("0.97x-1.05x", "")) is None
    with pytest.raises(ValueError):
        tradeoffs_time.baseline_spread(REPORT.replace("| baseline |", "| base |"))


def test_the_windows_are_the_adaptive_counts_or_every_row_times_its_forced_repeats():
    variants = [{"name": n} for n in ("baseline", "split", "lora")]
    assert tradeoffs_time.windows({"variants": variants, "repeats": 3,
                                   "windows": {"baseline": 3, "split": 3, "lora": 1}}) == (7, 9)
    assert tradeoffs_time.windows({"variants": variants, "repeats": 2}) == (6, 6)


STEPS = """| row | change | step 1 (s) | memory (MiB) | verdict |
|-----|--------|------------|--------------|---------|
| baseline | your params.yaml | 0.74 | 457 | baseline |
| adamw_torch_8bit | 8-bit AdamW states (torchao) | 4.36 | 328 | different training |
| compile | torch.compile (inductor) on | 25.50 | 457 | same in expectation |
"""


def test_the_compiling_rows_first_steps_are_read_from_the_report_and_rows_not_run_are_left_out():
    assert tradeoffs_time.first_steps(STEPS) == {"adamw_torch_8bit": 4.36, "compile": 25.5}
    assert tradeoffs_time.first_steps(STEPS.replace("step 1 (s)", "step one")) == {}
