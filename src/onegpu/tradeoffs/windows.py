"""How many probe windows each row of an ``onegpu tradeoffs`` batch gets: every row one, and another
only while one more could still change the recommendation. Pure logic on measured rows.

The rule is exact, not a guess: :func:`onegpu.tradeoffs.recommend.recommend` takes a knob with repeats
only when the slowest of its windows is faster than the baseline's fastest (its ratio above ``1 +`` the
baseline's spread, which is never negative), and only when it keeps the same training. So a row

- of another training (another optimizer, LoRA: :data:`~onegpu.tradeoffs.knobs.DIFFERENT`) is never a
  candidate, and needs no window beyond its first, where the verdict and the cost are measured;
- whose first window is not the same training (a lower precision outside fp32's tolerance, a divergence),
  failed, or is not faster than the baseline of its round (a ratio of 1 or less) is out whatever its
  later windows measure: the verdict shows the worst window, and the slowest ratio can only fall;
- with more of its windows below ``1 + MIN_GAIN`` than the median of all its windows allows (of 3: two)
  is out too: its median cannot reach the bar.

Every other row, and the baseline whose spread they must clear, runs the next round. ``--repeats R`` asks
for R windows of every row instead (the batch's plan then says ``"forced"``).
"""
from __future__ import annotations

from onegpu.tradeoffs import recommend
from onegpu.tradeoffs.knobs import DIFFERENT, Variant
from onegpu.tradeoffs.measurement import Row

BASELINE = "baseline"
REPEATS = 3  # the most windows of a row (onegpu.tradeoffs.batch.REPEATS)


def decided(row: Row, windows: int = REPEATS) -> str | None:
    """Why more windows of ``row`` (measured over its windows so far, against the baseline of each
    round; ``windows``: the most it can have) cannot change the recommendation, in words, or None when
    they could (the baseline: None)."""
    v = row.variant
    if v.knob == BASELINE:
        return None
    if v.expect == DIFFERENT:
        return "another training: never recommended"
    if row.run is None:
        return row.verdict  # failed; a stopped batch runs no further round anyway
    if not row.same_training:
        return f"{row.verdict}: never recommended"
    low = row.speedup_range[0] if row.speedup_range else row.speedup
    if low is None or low <= 1.0:
        return "not faster than the baseline" + (f" ({low:.2f}x)" if low is not None else "")
    below = sum(1 for x in row.ratios or (low,) if x < 1 + recommend.MIN_GAIN)
    if below >= windows // 2 + 1:  # the median of ``windows`` ratios is then below the bar too
        return f"{below} of its windows under the {recommend.MIN_GAIN:.0%} bar: its median cannot reach it"
    return None


def next_round(variants: list[Variant], rows: list[Row], windows: int = REPEATS) -> list[Variant]:
    """The variants of the next round: the baseline and each row still open (:func:`decided` None),
    in plan order; empty when no row is open (the baseline's spread would then decide nothing)."""
    open_rows = [v for v, r in zip(variants, rows) if v.knob != BASELINE and decided(r, windows) is None]
    return [v for v in variants if v.knob == BASELINE] + open_rows if open_rows else []


def reopenable(variants: list[Variant]) -> int:
    """How many of ``variants`` may run again after round 1: the baseline and every row not of another
    training (such a row is decided by its first window)."""
    return sum(1 for v in variants if v.knob == BASELINE or v.expect != DIFFERENT)


def window_range(variants: list[Variant], repeats: int, adaptive: bool = True) -> tuple[int, int]:
    """``(fewest, most)`` windows of a batch of ``variants``: forced (not ``adaptive``), every row
    ``repeats`` times; adaptive, every row once, then up to ``repeats - 1`` more rounds of the
    :func:`reopenable` rows."""
    if not adaptive:
        return (len(variants) * repeats,) * 2
    return len(variants), len(variants) + (repeats - 1) * reopenable(variants)
