"""Is one run the same training as its group's reference, step for step, and what does it cost?

Runs that share an ``equivalence_key`` (same data, model, optimizer, schedule, seed and effective batch;
only the split into micro-batch x accumulation, checkpointing and the backend may differ) are compared
with their group's reference (:mod:`onegpu.compare.groups`) per optimizer step:

* ``loss`` and ``grad_norm``: the largest absolute and relative difference over the steps both runs
  logged, and the first step whose loss or gradient-norm difference is beyond the tolerance of the
  run's precision (:mod:`onegpu.compare.tolerances`); optimizer step 1, before any update can amplify a
  difference, against the precision's noise floor of the reduction order (fp32 on a CPU), with the
  factor by which a run is above it;
* the number of optimizer steps;
* the final ``eval_*`` metrics (differences, run minus reference);
* the trade-off: memory and throughput relative to the reference.

The verdict is ``equivalent`` (every common step within tolerance and the same number of steps) or
``diverged at step N`` (``diverged at step N (grad_norm)`` when the gradient norm left its tolerance
before the loss did); params and tags that explain a divergence are listed as likely causes
(:mod:`onegpu.compare.causes`). An optimizer step that saw fewer examples than the effective batch (an
epoch's short last step, tag ``onegpu.partial_steps``) is noted. No MLflow here.

To add a verdict: a status constant here, the branch of :func:`compare_run` that sets it, its word in
:mod:`onegpu.compare.summary` and its marker in :data:`onegpu.compare.plots.STATUS_MARKERS`, and a
pair of records that reaches it in ``tests/unit/compare/test_verdict.py``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from onegpu.compare.causes import likely_causes, numerical_note
from onegpu.compare.records import RunRecord, Series
from onegpu.compare.tolerances import (
    FIRST_STEP_FLOOR,
    Tolerance,
    first_step_tolerance_for,
    grad_norm_tolerance_for,
    tolerance_for,
)

# Final figures compared between runs: the last validation point's loss (training) and the test split's (evaluate).
EVAL_METRICS = ("eval_loss", "test_loss", "test_accuracy", "test_f1_macro", "test_perplexity")

# Statuses of a compared run (``RunComparison.status``).
REFERENCE, EQUIVALENT, DIVERGED, INCOMPLETE, NO_DATA = "reference", "equivalent", "diverged", "incomplete", "no data"


@dataclass
class Diff:
    """Per-step differences of one metric against the reference over the steps both runs logged."""
    common_steps: int = 0
    max_abs: float | None = None    # largest |run - reference|, in the metric's unit
    max_rel: float | None = None    # largest |run - reference| / |reference|
    max_abs_step: int | None = None


@dataclass
class RunComparison:
    """One run of a group against the group's reference (the reference itself has status ``reference``).

    ``throughput_ratio`` and ``memory_ratio`` are this run's samples per second and peak bytes divided
    by the reference's (>1: faster / more memory).
    """
    run: RunRecord
    status: str
    verdict: str
    precision: str
    tolerance: Tolerance
    loss: Diff = field(default_factory=Diff)
    grad_norm: Diff = field(default_factory=Diff)
    eval_loss: Diff = field(default_factory=Diff)  # the validation curve, over the points both runs have
    grad_norm_tolerance: Tolerance = Tolerance(rtol=0.0, atol=0.0)
    first_divergent_step: int | None = None
    first_divergent_metric: str | None = None
    steps: int = 0
    reference_steps: int = 0
    eval_deltas: dict[str, float] = field(default_factory=dict)
    throughput_ratio: float | None = None
    memory_ratio: float | None = None
    causes: list[str] = field(default_factory=list)
    no_cause: str = ""  # no setting differs: what that means (causes.numerical_note); "" when causes exist
    first_step: dict[str, float] = field(default_factory=dict)  # metric -> relative difference at step 1
    first_step_tolerance: Tolerance | None = None
    notes: list[str] = field(default_factory=list)
    overlaps: list[str] = field(default_factory=list)

    @property
    def cost_comparable(self) -> bool:
        """False when this run's training overlapped in time with another run's on the same machine:
        they shared cores (and memory bandwidth), so its speed and memory say little about the split."""
        return not self.overlaps

    @property
    def speed_comparable(self) -> bool:
        """False when the training overlapped another run's, or ran under outside load (other processes
        took a tenth of the CPUs or used the GPU: :attr:`RunRecord.under_load`). Its memory, the
        process's own, stays comparable under outside load."""
        return self.cost_comparable and not self.run.under_load

    @property
    def is_reference(self) -> bool:
        return self.status == REFERENCE

    @property
    def step_mismatch(self) -> bool:
        """True when the run logged a different number of optimizer steps than the reference."""
        return self.steps != self.reference_steps



def _as_dict(series: Series) -> dict[int, float]:
    return {int(s): float(v) for s, v in series}


def _common(run: Series, reference: Series) -> tuple[list[int], np.ndarray, np.ndarray]:
    """The optimizer steps both series logged, sorted, and the two series' values at them."""
    a, b = _as_dict(run), _as_dict(reference)
    steps = sorted(a.keys() & b.keys())
    return steps, np.array([a[s] for s in steps], dtype=float), np.array([b[s] for s in steps], dtype=float)


def series_diff(run: Series, reference: Series) -> Diff:
    """Largest absolute and relative difference between two per-step series over their common steps.

    A NaN on one side only counts as an infinite difference, NaN on both sides as none; a step where the
    reference is 0 has relative difference 0 when the run is 0 too, else infinity."""
    steps, x, y = _common(run, reference)
    d = Diff(common_steps=len(steps))
    nan = np.isnan(x) | np.isnan(y)
    keep = ~(np.isnan(x) & np.isnan(y))
    if not keep.any():
        return d
    ad = np.where(nan, np.inf, np.abs(x - y))
    rd = np.divide(ad, np.abs(y), out=np.where(ad == 0, 0.0, np.inf), where=(y != 0) & ~nan)
    ad, rd, kept = ad[keep], rd[keep], [s for s, k in zip(steps, keep) if k]
    i = int(np.argmax(ad))
    d.max_abs, d.max_abs_step, d.max_rel = float(ad[i]), kept[i], float(rd.max())
    return d


def first_divergence(run: Series, reference: Series, tol: Tolerance) -> int | None:
    """The first common optimizer step where ``|run - reference| > atol + rtol * |reference|``
    (``numpy.isclose``; a NaN on one side only counts as a divergence, NaN on both sides does not);
    None when every common step is within tolerance."""
    steps, x, y = _common(run, reference)
    close = np.isclose(x, y, rtol=tol.rtol, atol=tol.atol, equal_nan=True)
    return next((s for s, ok in zip(steps, close) if not ok), None)


def first_step_beyond(run: Series, reference: Series, tol: Tolerance) -> float | None:
    """The relative difference at optimizer step 1 when it is beyond ``tol`` (``numpy.isclose``), else
    None (also when either series lacks step 1)."""
    a, b = _as_dict(run), _as_dict(reference)
    if 1 not in a or 1 not in b or np.isclose(a[1], b[1], rtol=tol.rtol, atol=tol.atol, equal_nan=True):
        return None
    return abs(a[1] - b[1]) / abs(b[1]) if b[1] else float("inf")


def _first_step(c: RunComparison, run: RunRecord, reference: RunRecord) -> None:
    """Step 1 against the noise floor of the reduction order (:data:`FIRST_STEP_TOLERANCES`): each metric
    beyond it goes into ``c.first_step`` and a note with its factor over the measured floor."""
    tol = c.first_step_tolerance = first_step_tolerance_for(run, reference)
    if tol is None:
        return
    floor = FIRST_STEP_FLOOR[c.precision]
    for metric in ("loss", "grad_norm"):
        rel = first_step_beyond(run.series.get(metric, []), reference.series.get(metric, []), tol)
        if rel is not None:
            c.first_step[metric] = rel
            c.notes.append(f"step 1 {metric} {rel:.1e} relative: {rel / floor:,.0f}x the {c.precision} noise floor "
                           f"of the reduction order ({floor:g}), before any update could amplify a difference")


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b not in (None, 0) else None


def compare_run(run: RunRecord, reference: RunRecord) -> RunComparison:
    """Compare ``run`` with ``reference`` per optimizer step and on its outcome and cost."""
    precision, tol = tolerance_for(run, reference)
    c = RunComparison(run=run, status=EQUIVALENT, verdict="equivalent", precision=precision, tolerance=tol,
                      grad_norm_tolerance=grad_norm_tolerance_for(run, reference),
                      steps=run.steps, reference_steps=reference.steps)
    for p in run.partial_steps:
        c.notes.append(f"optimizer step {p['step']} saw {p['examples']} of {p.get('effective_batch') or '?'} "
                       "examples (an epoch's short last step): its loss and gradient are over those only")
    c.throughput_ratio = _ratio(run.samples_per_second, reference.samples_per_second)
    c.memory_ratio = _ratio(run.peak_memory_bytes, reference.peak_memory_bytes)
    if run.status and run.status not in ("FINISHED", "RUNNING", "SCHEDULED"):  # SCHEDULED: not evaluated yet
        c.notes.append(f"run status {run.status}")
    if run is reference:
        c.status, c.verdict = REFERENCE, "reference"
        return c

    for m in EVAL_METRICS:
        if m in run.metrics and m in reference.metrics:
            c.eval_deltas[m] = run.metrics[m] - reference.metrics[m]
    if not any(m in run.metrics for m in EVAL_METRICS if m.startswith("test_")):
        c.notes.append("no test metrics (evaluate has not run)")

    loss, ref_loss = run.series.get("loss", []), reference.series.get("loss", [])
    c.loss = series_diff(loss, ref_loss)
    c.grad_norm = series_diff(run.series.get("grad_norm", []), reference.series.get("grad_norm", []))
    c.causes = likely_causes(run, reference)
    c.no_cause = "" if c.causes else numerical_note(run, reference)
    if c.loss.common_steps == 0:
        c.status = NO_DATA
        c.verdict = "no per-step loss" if not loss else "no common steps"
        return c
    _first_step(c, run, reference)
    at_loss = 1 if "loss" in c.first_step else first_divergence(loss, ref_loss, tol)
    at_norm = 1 if "grad_norm" in c.first_step else first_divergence(
        run.series.get("grad_norm", []), reference.series.get("grad_norm", []), c.grad_norm_tolerance)
    if at_loss is not None and (at_norm is None or at_loss <= at_norm):
        c.first_divergent_step, c.first_divergent_metric = at_loss, "loss"
    elif at_norm is not None:
        c.first_divergent_step, c.first_divergent_metric = at_norm, "grad_norm"
    _validation_curve(c, run, reference, tol)
    if c.step_mismatch:
        c.notes.append(f"{c.steps} optimizer steps, reference {c.reference_steps}")
    if c.first_divergent_step is not None:
        c.status, c.verdict = DIVERGED, (f"diverged at validation step {c.first_divergent_step}"
                                         if c.first_divergent_metric == "eval_loss" else
                                         f"diverged at step {c.first_divergent_step}"
                                         + (" (grad_norm)" if c.first_divergent_metric == "grad_norm" else ""))
    elif c.step_mismatch:
        c.status = INCOMPLETE
        c.verdict = f"equal for {c.loss.common_steps} steps, then {c.steps} vs {c.reference_steps} steps"
    return c


def _validation_curve(c: RunComparison, run: RunRecord, reference: RunRecord, tol: Tolerance) -> None:
    """The validation curves (``eval_loss`` at the points both runs have) within the loss tolerance: the same
    training gives the same validation loss at the same step. A divergence there (the training curves
    within tolerance) is the run's first (``first_divergent_metric`` ``eval_loss``); a note says how many
    points were compared and at which one the curve left the reference's, if it did."""
    ev, ref = run.series.get("eval_loss", []), reference.series.get("eval_loss", [])
    c.eval_loss = series_diff(ev, ref)
    if not c.eval_loss.common_steps:
        return
    at = first_divergence(ev, ref, tol)
    first = " (its first)" if at is not None and at == min(s for s, _ in ev) else ""
    c.notes.append(f"validation curve: {c.eval_loss.common_steps} common point(s), largest relative "
                   f"difference {c.eval_loss.max_rel:.2g}"
                   + (f"; diverged at validation step {at}{first}" if at is not None else ""))
    if at is not None and c.first_divergent_step is None:
        c.first_divergent_step, c.first_divergent_metric = at, "eval_loss"


@dataclass
class GroupComparison:
    """The runs that share one ``equivalence_key``; ``rows[0]`` is the reference."""
    key: str
    reference: RunRecord
    rows: list[RunComparison]
    summary: str = ""

    @property
    def runs(self) -> list[RunRecord]:
        return [r.run for r in self.rows]

    def count(self, status: str) -> int:
        return sum(r.status == status for r in self.rows)
