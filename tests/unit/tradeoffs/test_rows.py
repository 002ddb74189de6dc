"""Rows one at a time (onegpu.tradeoffs.rows): the time left; the loop itself is tested through its two
runners (test_queue.py with a fake dvc, test_pool.py with real worker processes)."""
from __future__ import annotations

from onegpu.tradeoffs import rows


def test_time_left_is_the_mean_row_times_the_rows_left():
    done = [rows.Ran("a", 0, 50.0), rows.Ran("b", 0, 70.0)]
    assert rows.time_left(done, 4) == "about 4 min 00 s left"
    assert rows.time_left(done, 0) == "about 0 s left"
    assert rows.time_left([], 3) == "time left: known after the first row"
