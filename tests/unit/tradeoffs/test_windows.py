"""How many windows each tradeoffs row gets (onegpu.tradeoffs.windows): the rule, and the rounds it drives
(onegpu.tradeoffs.batch.run_rounds) on a planted job, against every row forced to three windows."""
from __future__ import annotations

import pytest

from onegpu.tradeoffs import batch, knobs, windows
from onegpu.tradeoffs.measurement import measure_rows, repeat_name
from tests.unit.tradeoffs.runs import BASE, _run, _variant

FASTER = _variant("faster", "faster")                      # the same training, half the step time
SLOWER = _variant("slower", "slower")                      # the same training, twice the step time
OTHER = _variant("adafactor", "optimizer", knobs.DIFFERENT)  # another training, and faster
NEAR = _variant("near", "near")                            # the same training, within the baseline's spread
PLANTED = [BASE, FASTER, SLOWER, OTHER, NEAR]

# Step time (s) of each row's window r (1-based): the baseline's own windows spread +-3%.
STEP_TIME = {"baseline": (1.0, 1.03, 0.97), "faster": (0.5, 0.52, 0.49), "slower": (2.0, 2.1, 1.9),
             "adafactor": (0.6, 0.6, 0.6), "near": (0.98, 0.96, 1.0)}


def _planted_run(name: str):
    """The planted job's run of repeat ``name`` (``row`` or ``row-rN``)."""
    row, _, r = name.partition("-r")
    return _run(name, key="k2" if row == "adafactor" else "k1", step_time=STEP_TIME[row][int(r or 1) - 1])


@pytest.fixture
def planted(tmp_path, monkeypatch):
    """A batch runner that "trains" each row it is given into a store of planted runs; returns the store."""
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))
    store: dict = {}

    def run_rows(prefix, rows, targets, force, window):
        for v in rows:
            store[v.name] = _planted_run(v.name)
        return [batch.queue.Ran(prefix + v.name, 0, 1.0) for v in rows], False
    monkeypatch.setattr(batch.queue, "run_rows", run_rows)
    return store


def _measured(name: str, store: dict):
    return batch.measure(batch.load_plan(name), lambda: dict(store), None, False, False, "here")


def test_the_rounds_time_only_what_can_change_the_answer_and_recommend_as_three_forced_repeats(planted, capsys):
    """The slower row and the other training are decided after one window; the faster row, the one within
    the spread and the baseline run three; the recommendation (the faster row, alone) is what three
    windows of every row give, from 11 windows instead of 15."""
    batch.save("0101-000001", PLANTED, [], {"steps": 6, "repeats": 3, "forced": False})
    assert batch.run_rounds("0101-000001", PLANTED, 3, 6, None, None, lambda: dict(planted)) is False
    ran = sorted(planted)
    assert ran == sorted(["baseline", "faster", "slower", "adafactor", "near", "baseline-r2", "faster-r2",
                          "near-r2", "baseline-r3", "faster-r3", "near-r3"])
    assert batch.load_plan("0101-000001")["windows"] == {"baseline": 3, "faster": 3, "slower": 1, "adafactor": 1,
                                                        "near": 3}
    adaptive = _measured("0101-000001", planted)
    out = capsys.readouterr().out
    assert ("round 2 of at most 3: the baseline and 2 row(s) whose gain could still clear the spread: "
            "faster, near") in out

    forced_store = {repeat_name(v.name, r): _planted_run(repeat_name(v.name, r)) for r in (1, 2, 3) for v in PLANTED}
    batch.save("0101-000002", PLANTED, [], {"steps": 6, "repeats": 3, "forced": True})
    forced = _measured("0101-000002", forced_store)
    assert adaptive.recommendation.variant == forced.recommendation.variant == FASTER
    assert [p.variant.name for p in adaptive.recommendation.parts] == ["faster"]
    assert dict(adaptive.recommendation.left_out).keys() == dict(forced.recommendation.left_out).keys() == {
        "slower", "near"}
    by = {r.variant.name: r for r in adaptive.rows}
    assert by["slower"].repeats == 1 and by["faster"].repeats == 3 and by["baseline"].repeats == 3
    assert "1 window: decided, not timed further (not faster than the baseline (0.50x))" in by["slower"].notes
    assert "1 window: decided, not timed further (another training: never recommended)" in by["adafactor"].notes
    assert not any("decided" in n for n in by["faster"].notes + by["baseline"].notes)


def test_no_round_follows_when_every_row_is_decided_after_its_first_window(planted, capsys):
    """Only a slower row and another training: the baseline's spread could decide nothing, so it runs once."""
    rows = [BASE, SLOWER, OTHER]
    batch.save("0101-000003", rows, [], {"steps": 6, "repeats": 3, "forced": False})
    batch.run_rounds("0101-000003", rows, 3, 6, None, None, lambda: dict(planted))
    assert sorted(planted) == ["adafactor", "baseline", "slower"]
    assert "round 2: no row is left whose next window could change the recommendation" in capsys.readouterr().out
    m = _measured("0101-000003", planted)
    assert m.recommendation.variant is None and m.recommendation.incomplete is None


@pytest.mark.parametrize("step_times,expect,why", [
    ((1.0,), knobs.SAME, None),                      # the baseline itself
    ((0.5,), knobs.SAME, None),                      # faster, the same training: open
    ((1.0,), knobs.SAME, "not faster than the baseline (1.00x)"),
    ((0.5, 1.1), knobs.SAME, "not faster than the baseline (0.91x)"),  # its slowest window decides
    ((0.5,), knobs.DIFFERENT, "another training: never recommended"),
])
def test_a_row_is_decided_when_no_window_can_make_it_recommended(step_times, expect, why):
    name = "baseline" if why is None and step_times == (1.0,) else "row"
    v = BASE if name == "baseline" else _variant("row", "row", expect)
    runs = {repeat_name("baseline", r): _run("b", step_time=1.0) for r in (1, 2)}
    runs.update({repeat_name("row", r): _run("r", key="k2" if expect == knobs.DIFFERENT else "k1", step_time=t)
                 for r, t in enumerate(step_times, 1)})
    [row] = measure_rows([v], runs, {v.name: len(step_times)})
    assert windows.decided(row) == why


def test_a_row_of_another_precision_outside_fp32_tolerance_is_decided_after_its_first_window():
    bf16 = _variant("bf16", "precision", knobs.PRECISION)
    runs = {"baseline": _run("b"), "bf16": _run("p", step_time=0.5, loss_scale=1.001)}
    [row] = measure_rows([bf16], runs, 1)
    assert not row.same_training and windows.decided(row) == f"{row.verdict}: never recommended"
    assert windows.next_round([BASE, bf16], measure_rows([BASE, bf16], runs, 1)) == []


def test_a_row_whose_median_cannot_reach_the_bar_is_decided_before_its_last_window():
    """Two windows of three under 1.05x (1.02x, 1.04x): the median of three is under the bar whatever the
    third measures, so it is decided; one window under the bar of three is not yet."""
    v = _variant("row", "row")
    runs = {repeat_name("baseline", r): _run("b", step_time=1.0) for r in (1, 2)}
    runs.update({repeat_name("row", r): _run("r", step_time=1 / x) for r, x in ((1, 1.02), (2, 1.04))})
    [two] = measure_rows([v], runs, {"row": 2})
    assert windows.decided(two, 3) == "2 of its windows under the 5% bar: its median cannot reach it"
    [one] = measure_rows([v], runs, {"row": 1})
    assert windows.decided(one, 3) is None


def test_the_window_range_is_every_row_once_then_the_rows_that_may_run_again():
    """The planted batch: 5 rows, one of another training: 5 to 13 windows adaptive, 15 forced."""
    assert windows.window_range(PLANTED, 3) == (5, 13)
    assert windows.window_range(PLANTED, 3, adaptive=False) == (15, 15)
