"""``onegpu tradeoffs``' recommendation: the fastest configuration that keeps the same training and fits
the memory budget, combined from the knobs that were measurably faster on their own. Pure logic."""
from __future__ import annotations

from dataclasses import dataclass

from onegpu.tradeoffs.knobs import DIFFERENT, SAME, Variant
from onegpu.tradeoffs.measurement import Row, failed

# A variant counts as faster only when its steady-state samples/s beat the baseline's by this share:
# identical runs on a small shared CPU differ by several percent (bench/README.md, "Reading these numbers").
MIN_GAIN = 0.05


def load_reason(row: Row, baseline: Row | None = None) -> str:
    """Why ``row``'s speed-up is no measurement of its knob: its run, or the baseline's, trained under
    outside load (:attr:`onegpu.compare.RunRecord.under_load`, with the figures); '' when neither did."""
    if row.run is not None and row.run.under_load:
        return f"speed measured under outside load: {row.run.under_load}"
    if baseline is not None and baseline is not row and baseline.run is not None and baseline.run.under_load:
        return f"the baseline's speed measured under outside load: {baseline.run.under_load}"
    return ""


@dataclass
class Recommendation:
    """The fastest same-training configuration that fits the budget.

    Attributes:
        variant: the combined variant (its overrides), or None when the user's params are already the
            fastest measured same-training configuration.
        parts: the rows whose knobs it combines.
        left_out: ``(row name, reason)`` for the same-training rows not taken.
        budget_bytes: the memory budget it was checked against (None: no budget).
        incomplete: ``(measured, planned)`` rows when some planned row has no measured run (not run,
            queued, running or stopped): then nothing is recommended. None: every row was measured
            (a row that failed is a measured outcome).
    """
    variant: Variant | None
    parts: list[Row]
    left_out: list[tuple[str, str]]
    budget_bytes: float | None
    incomplete: tuple[int, int] | None = None


def completeness(rows: list[Row]) -> tuple[int, int] | None:
    """``(measured, planned)`` when a row is missing (no finished run and not failed), else None."""
    measured = sum(1 for r in rows if r.run is not None or failed(r))
    return None if measured == len(rows) else (measured, len(rows))


def noise(rows: list[Row]) -> float:
    """The baseline's own spread: its fastest repeat's samples/s over its median, minus 1 (0 with one run)."""
    base = next((r for r in rows if r.variant.knob == "baseline"), None)
    return base.speedup_range[1] - 1 if base is not None and base.speedup_range else 0.0


def clear_gain(r: Row, min_gain: float, base_noise: float) -> bool:
    """``r`` is faster beyond noise: its median speed-up at least ``1 + min_gain``, and with repeats its
    slowest repeat's ratio above the baseline's fastest repeat (``1 + base_noise``): the gain is clear
    of the spread of its own repeats and of the baseline's."""
    low = r.speedup_range[0] if r.speedup_range else r.speedup
    return r.speedup >= 1 + min_gain and (r.repeats == 1 or low > 1 + base_noise)


def confirmed(measured: Row | None, rows: list[Row], min_gain: float | None = None) -> bool:
    """The combination's own repeats confirm it: it ran, kept the same training and its gain over the
    baseline is clear (:func:`clear_gain`, against the baseline's spread in ``rows``)."""
    min_gain = MIN_GAIN if min_gain is None else min_gain
    return (measured is not None and measured.run is not None and measured.same_training
            and measured.speedup is not None and clear_gain(measured, min_gain, noise(rows)))


def spread(r: Row) -> str:
    lo, hi = r.speedup_range or (r.speedup, r.speedup)
    return f"{r.speedup:.2f}x, {lo:.2f}x-{hi:.2f}x over {r.repeats} repeats" if r.repeats > 1 else f"{r.speedup:.2f}x"


def recommend(rows: list[Row], budget_bytes: float | None, min_gain: float | None = None) -> Recommendation:
    """Combine the knobs whose runs kept the same training (fp32 tolerance; TF32 within its own; other
    dropout masks only: :data:`IN_EXPECTATION`),
    fit ``budget_bytes`` (compared with :attr:`Row.memory_bytes`; None = no budget) and were at least
    ``min_gain`` faster than the baseline in steady-state samples/s. One knob's variant stands for
    itself; several are merged into a ``recommended`` variant (their overrides together), which must be
    measured once more: knobs do not multiply exactly. ``min_gain`` None: :data:`MIN_GAIN`. With repeats
    a knob must also clear the spreads (:func:`clear_gain`), else it is "no clear difference". A batch
    with a row missing recommends nothing (:attr:`Recommendation.incomplete`)."""
    min_gain = MIN_GAIN if min_gain is None else min_gain
    if (incomplete := completeness(rows)) is not None:
        return Recommendation(None, [], [], budget_bytes, incomplete)
    parts, left_out, base_noise = [], [], noise(rows)
    base = next((r for r in rows if r.variant.knob == "baseline"), None)
    for r in rows:
        if r.variant.knob in ("baseline", "recommended") or r.variant.expect == DIFFERENT:
            continue  # a different training is never a candidate
        if r.run is None:  # failed
            left_out.append((r.variant.name, r.verdict))
        elif not r.same_training:
            left_out.append((r.variant.name, r.verdict))
        elif budget_bytes is not None and (r.memory_bytes is None or r.memory_bytes > budget_bytes):
            left_out.append((r.variant.name, "over the memory budget"))
        elif load_reason(r, base):
            left_out.append((r.variant.name, load_reason(r, base)))
        elif r.speedup is None or (r.speedup < 1 and r.speedup < 1 + min_gain):
            left_out.append((r.variant.name, "not faster"))
        elif r.repeats > 1 and not clear_gain(r, min_gain, base_noise):
            left_out.append((r.variant.name, f"no clear difference ({spread(r)}; the baseline's own "
                                             f"spread +{base_noise:.0%})"))
        elif not clear_gain(r, min_gain, base_noise):
            left_out.append((r.variant.name, f"{(r.speedup - 1) * 100:.0f}% faster: within run-to-run noise"))
        else:
            parts.append(r)
    # One row per knob: the faster one when a knob has two rows (e.g. fused and for-each AdamW).
    best: dict[str, Row] = {}
    for r in parts:
        if r.variant.knob not in best or r.speedup > best[r.variant.knob].speedup:
            best[r.variant.knob] = r
    parts = sorted(best.values(), key=lambda r: -r.speedup)
    if not parts:
        return Recommendation(None, [], left_out, budget_bytes)
    if len(parts) == 1:
        return Recommendation(parts[0].variant, parts, left_out, budget_bytes)
    overrides = tuple(dict.fromkeys(o for r in parts for o in r.variant.overrides))  # shared -S once
    what = " + ".join(r.variant.name for r in parts)
    return Recommendation(Variant("recommended", "recommended", overrides, SAME, what), parts, left_out,
                          budget_bytes)
