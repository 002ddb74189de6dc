"""Are runs with the same ``equivalence_key`` the same training, step for step, and what does each cost?

Pure logic on plain records (no MLflow here; :mod:`onegpu.tracking` fetches the runs). For each group of
training runs that share an ``equivalence_key`` (same data, model, optimizer, schedule, seed and
effective batch; only the split into micro-batch x accumulation, checkpointing and the backend may
differ), one run is the reference and every other run is compared with it per optimizer step:

* ``loss`` and ``grad_norm``: the largest absolute and relative difference over the steps both runs
  logged, and the first step whose loss or gradient-norm difference is beyond the tolerance of the
  run's precision (:data:`TOLERANCES`, :data:`GRAD_NORM_TOLERANCES`, basis in :data:`TOLERANCE_BASIS`);
* the number of optimizer steps;
* the final ``eval_*`` metrics (differences, run minus reference);
* the trade-off: micro-batch, accumulation, checkpointing, peak memory (bytes), throughput (samples per
  second), mean step time (seconds per optimizer step), and memory and throughput relative to the
  reference.

The verdict is ``equivalent`` (every common step within tolerance and the same number of steps) or
``diverged at step N`` (``diverged at step N (grad_norm)`` when the gradient norm left its tolerance
before the loss did); params and tags that explain a divergence are listed as likely causes
(:func:`likely_causes`).

Speed and memory are only comparable between runs that did not compete for the machine: runs whose
training windows (first to last optimizer step, tags ``onegpu.train_start_ms``/``onegpu.train_end_ms``)
overlapped on one machine are flagged (:func:`find_overlaps`) and left out of "fastest"/"least memory".
An optimizer step that saw fewer examples than the effective batch (an epoch's short last step, tag
``onegpu.partial_steps``) is noted.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from onegpu.equivalence.key import (KEY_TAG, RESOLVED_ACCUMULATION, RESOLVED_EFFECTIVE_BATCH,
                                   RESOLVED_MICRO_BATCH)


class Tolerance(NamedTuple):
    """Per-step tolerance: a step differs when ``|x - ref| > atol + rtol * |ref|`` (``numpy.isclose(x, ref)``)."""
    rtol: float
    atol: float


# Machine epsilon (spacing of floats at 1.0) of each training precision: IEEE 754 binary32 2^-23,
# bfloat16 2^-7 (8-bit significand), binary16 2^-10.
# TF32 (train.tf32 on a CUDA GPU): matmul inputs rounded to a 10-bit mantissa, 2^-10, accumulated in fp32.
EPS = {"fp32": 2.0**-23, "tf32": 2.0**-10, "bf16": 2.0**-7, "fp16": 2.0**-10}

# Tolerances by training precision, for the loss and for the gradient norm of each optimizer step.
TOLERANCES: dict[str, Tolerance] = {
    "fp32": Tolerance(rtol=1e-4, atol=1e-6),
    "tf32": Tolerance(rtol=2e-3, atol=1e-5),
    "bf16": Tolerance(rtol=1e-2, atol=1e-4),
    "fp16": Tolerance(rtol=1e-2, atol=1e-4),
}
GRAD_NORM_TOLERANCES: dict[str, Tolerance] = {
    "fp32": Tolerance(rtol=1e-3, atol=1e-6),
    "tf32": Tolerance(rtol=1e-2, atol=1e-5),
    "bf16": Tolerance(rtol=5e-2, atol=1e-4),
    "fp16": Tolerance(rtol=5e-2, atol=1e-4),
}
# Why these numbers (shown in the report). A split of the effective batch (4 x 16 against 64 x 1),
# checkpointing or the backend changes only the order of floating-point sums: the step's first
# difference is a few eps (rounding of a reordered sum grows like sqrt(n) * eps typically, n * eps at
# worst: Higham, "Accuracy and Stability of Numerical Algorithms", 2nd ed., sec. 4.2), and each
# optimizer update carries the previous step's difference forward, so it grows with the steps.
TOLERANCE_BASIS: dict[str, str] = {
    "fp32": ("eps 1.19e-7; measured here 1.1e-7 (loss) and 2.0e-7 (grad_norm) relative after 6 AdamW steps "
             "of a tiny BERT, for 4x2, 2x4 and 1x8 against 8x1, checkpointing and the other backend; loss "
             "rtol 1e-4 (~840 eps) leaves three orders of magnitude for growth over hundreds of steps, "
             "while a real change (another dropout mask, BatchNorm statistics of a smaller micro-batch) "
             "moves the loss by 1e-3 or more at once; the gradient norm gets 10x more (1e-3): it is a "
             "derivative, smaller than the loss late in training, so the same weight difference moves it "
             "more in relative terms"),
    "tf32": ("eps 9.8e-4: TF32 rounds matmul inputs to 11 significant bits and accumulates in fp32, so a "
             "reordered sum can move an activation by ~eps/2; as for bf16, loss rtol 2e-3 (~2 eps, the loss is "
             "reduced in fp32), grad_norm 1e-2 (~10 eps); applies to runs with train.tf32 on a CUDA device "
             "(a no-op on CPU: fp32 there); not measured here (no Ampere GPU in the tests)"),
    "bf16": ("eps 7.8e-3: autocast rounds matmul inputs to 8 significant bits, so a reordered sum can move "
             "an activation by ~eps/2; loss rtol 1e-2 (~1.3 eps, the loss is reduced in fp32), grad_norm "
             "5e-2; not measured here (no bf16 pair in the tests)"),
    "fp16": ("eps 9.8e-4, plus dynamic loss scaling that may skip different steps; loss rtol 1e-2 "
             "(~10 eps), grad_norm 5e-2; not measured here"),
}
# ``atol`` only guards values near zero, where a relative test means nothing.

EVAL_METRICS = ("eval_loss", "eval_accuracy", "eval_f1_macro", "eval_perplexity")

# Statuses of a compared run (``RunComparison.status``).
REFERENCE, EQUIVALENT, DIVERGED, INCOMPLETE, NO_DATA = "reference", "equivalent", "diverged", "incomplete", "no data"

Series = list[tuple[int, float]]


# -- the record of one training run ------------------------------------------------------------------

def _bool(v) -> bool:
    return str(v).strip().lower() in ("true", "1", "yes")


def _int(v) -> int | None:
    try:
        return int(float(str(v)))
    except (TypeError, ValueError):
        return None


def _float(v) -> float | None:
    try:
        x = float(str(v))
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


@dataclass
class RunRecord:
    """One training run as logged to MLflow (params and tags are MLflow's strings).

    Attributes:
        run_id, name: MLflow's run id and run name (the DVC experiment name when there is one).
        params: ``train.*``, ``model.*``, ``resolved.*`` ... as logged.
        tags: ``equivalence_key``, ``device``, ``model.dropout_max``, ``model.batchnorm_layers``,
            ``dvc.exp_name``, ``mlflow.source.git.commit`` ...
        metrics: the last value of each metric (``train_mem_peak_bytes`` in bytes,
            ``train_samples_per_second``, ``eval_*``).
        series: per-step histories, ``{"loss": [(optimizer step, value), ...], ...}``, sorted by step.
        start_time: MLflow's start time, milliseconds since the epoch.
        status: MLflow's run status (SCHEDULED between train and evaluate, RUNNING while a stage writes).
        window: ``(first, last)`` step-metric timestamps in ms, for runs without the window tags.
    """
    run_id: str
    name: str
    params: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    series: dict[str, Series] = field(default_factory=dict)
    start_time: int = 0
    status: str = ""
    window: tuple[int, int] | None = None

    @property
    def train_window(self) -> tuple[int, int] | None:
        """``(first, last)`` milliseconds since the epoch of training's optimizer steps: the tags
        ``onegpu.train_start_ms``/``onegpu.train_end_ms`` the train stage sets, else ``window`` (the
        store's step-metric timestamps, for runs from before those tags); None when unknown."""
        a, b = _int(self.tags.get("onegpu.train_start_ms")), _int(self.tags.get("onegpu.train_end_ms"))
        if a is not None and b is not None:
            return a, b
        return tuple(self.window) if self.window else None

    @property
    def partial_steps(self) -> list[dict]:
        """Optimizer steps that saw fewer examples than the effective batch: from the tag
        ``onegpu.partial_steps``, else the ``step_examples`` series; ``[{"step", "examples", ...}]``."""
        raw = self.tags.get("onegpu.partial_steps")
        if raw:
            try:
                return list(json.loads(raw))
            except ValueError:
                pass
        eff = self.effective_batch
        return [{"step": s, "examples": int(v), "effective_batch": eff}
                for s, v in self.series.get("step_examples", []) if eff and v < eff]

    @property
    def key(self) -> str | None:
        """The ``equivalence_key`` tag (None when the run has none)."""
        return self.tags.get(KEY_TAG) or None

    @property
    def label(self) -> str:
        """The run name, else the first 8 characters of its id."""
        return self.name or self.run_id[:8]

    @property
    def micro_batch(self) -> int | None:
        """Examples per micro-batch (forward/backward pass), as resolved by the train stage."""
        return _int(self.params.get(RESOLVED_MICRO_BATCH, self.params.get("train.per_device_train_batch_size")))

    @property
    def accumulation(self) -> int | None:
        """Micro-batches per optimizer step."""
        return _int(self.params.get(RESOLVED_ACCUMULATION, self.params.get("train.gradient_accumulation_steps")))

    @property
    def effective_batch(self) -> int | None:
        """Examples per optimizer step."""
        v = _int(self.params.get(RESOLVED_EFFECTIVE_BATCH))
        if v is None and self.micro_batch and self.accumulation:
            v = self.micro_batch * self.accumulation
        return v

    @property
    def checkpointing(self) -> bool:
        """Activation (gradient) checkpointing on."""
        return _bool(self.params.get("train.gradient_checkpointing", False))

    @property
    def precision(self) -> str:
        """``bf16``, ``fp16`` (mixed precision), ``tf32`` (``train.tf32`` on a device other than ``cpu``,
        as tagged; TF32 is a no-op on CPU) or ``fp32``."""
        if _bool(self.params.get("train.bf16", False)):
            return "bf16"
        if _bool(self.params.get("train.fp16", False)):
            return "fp16"
        if _bool(self.params.get("train.tf32", False)) and self.tags.get("device", "").lower() != "cpu":
            return "tf32"
        return "fp32"

    @property
    def split(self) -> str:
        """``micro x accumulation``, with `` ckpt`` when checkpointing is on (e.g. ``4x16 ckpt``)."""
        s = f"{self.micro_batch if self.micro_batch is not None else '?'}x" \
            f"{self.accumulation if self.accumulation is not None else '?'}"
        return s + (" ckpt" if self.checkpointing else "")

    @property
    def peak_memory_bytes(self) -> float | None:
        """Peak memory during training, bytes (``train_mem_peak_bytes``; else the largest per-step peak)."""
        v = self.metrics.get("train_mem_peak_bytes")
        if v is None and self.series.get("mem_peak_bytes"):
            v = max(x for _, x in self.series["mem_peak_bytes"])
        return v

    @property
    def samples_per_second(self) -> float | None:
        """Training throughput, examples per second (``train_samples_per_second``; else the per-step mean)."""
        v = self.metrics.get("train_samples_per_second")
        if v is None and self.series.get("samples_per_second"):
            xs = [x for _, x in self.series["samples_per_second"]]
            v = sum(xs) / len(xs)
        return v

    @property
    def mean_step_time_s(self) -> float | None:
        """Mean wall time of an optimizer step, seconds (all its micro-batches)."""
        xs = [x for _, x in self.series.get("step_time_s", [])]
        return sum(xs) / len(xs) if xs else None

    @property
    def steps(self) -> int:
        """Optimizer steps with a logged loss."""
        return len(self.series.get("loss", []))


# -- comparison results ------------------------------------------------------------------------------

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
    grad_norm_tolerance: Tolerance = Tolerance(rtol=0.0, atol=0.0)
    first_divergent_step: int | None = None
    first_divergent_metric: str | None = None
    steps: int = 0
    reference_steps: int = 0
    eval_deltas: dict[str, float] = field(default_factory=dict)
    throughput_ratio: float | None = None
    memory_ratio: float | None = None
    causes: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    overlaps: list[str] = field(default_factory=list)

    @property
    def cost_comparable(self) -> bool:
        """False when this run's training overlapped in time with another run's on the same machine:
        they shared cores (and memory bandwidth), so its speed and memory say little about the split."""
        return not self.overlaps

    @property
    def is_reference(self) -> bool:
        return self.status == REFERENCE

    @property
    def step_mismatch(self) -> bool:
        """True when the run logged a different number of optimizer steps than the reference."""
        return self.steps != self.reference_steps


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


@dataclass
class Comparison:
    """Every group, most recently started first, and the runs left out (no ``equivalence_key`` tag)."""
    groups: list[GroupComparison]
    skipped: list[RunRecord] = field(default_factory=list)


# -- logic -------------------------------------------------------------------------------------------

def group_by_key(runs: list[RunRecord]) -> tuple[dict[str, list[RunRecord]], list[RunRecord]]:
    """``({equivalence_key: runs}, runs without a key)``; keys in first-seen order."""
    groups: dict[str, list[RunRecord]] = {}
    skipped = []
    for r in runs:
        if r.key is None:
            skipped.append(r)
        else:
            groups.setdefault(r.key, []).append(r)
    return groups, skipped


def choose_reference(runs: list[RunRecord]) -> RunRecord:
    """The run the others are compared with: the largest micro-batch (the fewest accumulated
    micro-batches, the plainest computation of the effective batch); on a tie, checkpointing off; then
    the earliest start. Runs with a per-step loss are preferred over runs without one.
    """
    if not runs:
        raise ValueError("choose_reference needs at least one run")
    with_loss = [r for r in runs if r.series.get("loss")] or runs
    return min(with_loss, key=lambda r: (-(r.micro_batch or 0), r.checkpointing, r.start_time, r.run_id))


def tolerance_for(run: RunRecord, reference: RunRecord) -> tuple[str, Tolerance]:
    """The precision that decides the tolerance of a pair (the lower of the two) and its tolerance."""
    order = ("fp32", "tf32", "fp16", "bf16")  # ascending tolerance
    p = max(run.precision, reference.precision, key=order.index)
    return p, TOLERANCES[p]


def grad_norm_tolerance_for(run: RunRecord, reference: RunRecord) -> Tolerance:
    """The gradient-norm tolerance of a pair (the looser precision of the two)."""
    return GRAD_NORM_TOLERANCES[tolerance_for(run, reference)[0]]


def _machine(r: RunRecord) -> str | None:
    return r.tags.get("onegpu.machine") or None


def find_overlaps(runs: list[RunRecord], others: list[RunRecord] = (),
                  min_overlap_ms: int = 1000) -> dict[str, list[str]]:
    """For each of ``runs``: the labels of runs (among ``runs`` and ``others``) whose training windows
    (:attr:`RunRecord.train_window`) overlapped its own by more than ``min_overlap_ms`` on the same
    machine (tag ``onegpu.machine``; runs without it are taken to share the machine). Runs of unknown
    window are never flagged. Returns ``{run_id: [label, ...]}`` for the runs that overlapped.
    """
    pool = {r.run_id: r for r in [*runs, *others]}
    out: dict[str, list[str]] = {}
    for r in runs:
        w = r.train_window
        if w is None:
            continue
        for o in pool.values():
            if o.run_id == r.run_id or o.train_window is None:
                continue
            if _machine(r) and _machine(o) and _machine(r) != _machine(o):
                continue
            ow = o.train_window
            if min(w[1], ow[1]) - max(w[0], ow[0]) > min_overlap_ms:
                out.setdefault(r.run_id, []).append(o.label)
    return out


def _as_dict(series: Series) -> dict[int, float]:
    return {int(s): float(v) for s, v in series}


def series_diff(run: Series, reference: Series) -> Diff:
    """Largest absolute and relative difference between two per-step series over their common steps."""
    a, b = _as_dict(run), _as_dict(reference)
    common = sorted(a.keys() & b.keys())
    d = Diff(common_steps=len(common))
    for s in common:
        x, y = a[s], b[s]
        if math.isnan(x) or math.isnan(y):
            if math.isnan(x) and math.isnan(y):
                continue
            ad, rd = math.inf, math.inf
        else:
            ad = abs(x - y)
            rd = ad / abs(y) if y != 0 else (0.0 if ad == 0 else math.inf)
        if d.max_abs is None or ad > d.max_abs:
            d.max_abs, d.max_abs_step = ad, s
        if d.max_rel is None or rd > d.max_rel:
            d.max_rel = rd
    return d


def first_divergence(run: Series, reference: Series, tol: Tolerance) -> int | None:
    """The first common optimizer step where ``|run - reference| > atol + rtol * |reference|``
    (``numpy.isclose``; a NaN on one side only counts as a divergence, NaN on both sides does not);
    None when every common step is within tolerance."""
    a, b = _as_dict(run), _as_dict(reference)
    steps = sorted(a.keys() & b.keys())
    close = np.isclose([a[s] for s in steps], [b[s] for s in steps], rtol=tol.rtol, atol=tol.atol,
                       equal_nan=True)
    return next((s for s, ok in zip(steps, close) if not ok), None)


def _dropout(r: RunRecord) -> float:
    # The model's largest dropout probability (tag set by the train stage); else the params override.
    v = _float(r.tags.get("model.dropout_max"))
    return v if v is not None else (_float(r.params.get("model.dropout")) or 0.0)


# Knobs outside the equivalence key (or, for train.optim, values it treats as one) that change the kernels
# or precision of the same mathematics: (param, value when not logged, why the losses can move).
KERNEL_KNOBS = (
    ("train.tf32", "false", "TF32 matmuls round their inputs to 10 mantissa bits on Ampere+ GPUs "
                            "(no effect on CPU)"),
    ("model.attn_implementation", "none", "another attention kernel sums in another order"),
    ("train.torch_compile", "false", "compiled, fused kernels sum in another order"),
    ("train.torch_compile_mode", "none", "other compiled kernels sum in another order"),
    ("train.optim", "adamw_torch", "the fused AdamW kernel rounds the same update differently"),
    ("train.dataloader_pin_memory", "none", "page-locked host memory; no arithmetic changes, unlikely alone"),
    ("train.torch_empty_cache_steps", "none", "allocator cache only; no arithmetic changes, unlikely alone"),
    ("train.cpu_allocator", "system", "host allocator only; no arithmetic changes, unlikely alone"),
)


# Knobs whose kernels draw dropout masks differently (SDPA's fused dropout, inductor's generated RNG code).
DROPOUT_KERNEL_KNOBS = ("model.attn_implementation", "train.torch_compile")


def _param(r: RunRecord, key: str, default: str) -> str:
    """A logged param in lower case (``None``/``null`` as ``none``), ``default`` when the run lacks it."""
    v = str(r.params.get(key, default)).strip().lower()
    return "none" if v in ("none", "null", "") else v


def likely_causes(run: RunRecord, reference: RunRecord) -> list[str]:
    """Params and tags of a pair that explain why their losses can differ step by step.

    Detected: dropout with a different micro-batch split or another attention/compiled kernel (other
    masks); BatchNorm with a different
    micro-batch (statistics per micro-batch); mixed precision; a knob of :data:`KERNEL_KNOBS` that
    differs (tf32, attention kernel, torch.compile, fused AdamW, ...); non-deterministic GPU kernels (device
    tag not ``cpu``); a different backend; a different device; a different code commit.
    """
    causes = []
    split_differs = run.micro_batch != reference.micro_batch
    ms = f"{run.micro_batch} vs {reference.micro_batch}"
    dropout = max(_dropout(run), _dropout(reference))
    if dropout > 0 and split_differs:
        causes.append(f"dropout (p up to {dropout:g}) with a different micro-batch ({ms}): each split "
                      "draws different dropout masks, so the runs agree only in expectation "
                      "(set model.dropout: 0 to compare exactly)")
    kernels = [k for k in DROPOUT_KERNEL_KNOBS if _param(run, k, "none") != _param(reference, k, "none")]
    if dropout > 0 and kernels:
        causes.append(f"dropout (p up to {dropout:g}) with another kernel ({', '.join(kernels)} differs): "
                      "it draws its dropout masks from the random generator in another way, so the runs "
                      "agree only in expectation (set model.dropout: 0 to compare exactly)")
    bn = max(_int(run.tags.get("model.batchnorm_layers")) or 0,
             _int(reference.tags.get("model.batchnorm_layers")) or 0)
    if bn > 0 and split_differs:
        causes.append(f"{bn} BatchNorm layer(s) with a different micro-batch ({ms}): mean and variance "
                      "are computed per micro-batch, so the forward pass itself differs")
    mixed = sorted({r.precision for r in (run, reference) if r.precision not in ("fp32", "tf32")})
    if mixed:
        causes.append(f"mixed precision ({', '.join(mixed)}): activations are rounded to "
                      f"{'/'.join(mixed)}, and a different summation order rounds differently")
    gpus = sorted({r.tags.get("device", "") for r in (run, reference)
                   if r.tags.get("device") and r.tags.get("device", "").lower() != "cpu"})
    if gpus:
        causes.append(f"non-deterministic GPU kernels ({', '.join(gpus)}): atomic adds in reductions and "
                      "kernel choice by shape make sums differ between runs")
    for knob, default, why in KERNEL_KNOBS:
        a, b = _param(run, knob, default), _param(reference, knob, default)
        if a != b:
            causes.append(f"{knob} differs ({a} vs {b}): {why}")
    rb, fb = run.params.get("train.backend"), reference.params.get("train.backend")
    if rb and fb and rb != fb:
        causes.append(f"a different backend ({rb} vs {fb}): the training loops order the work differently")
    rd, fd = run.tags.get("device"), reference.tags.get("device")
    if rd and fd and rd != fd:
        causes.append(f"a different device ({rd} vs {fd})")
    rc, fc = run.tags.get("mlflow.source.git.commit"), reference.tags.get("mlflow.source.git.commit")
    if rc and fc and rc != fc and "none" not in (rc, fc):
        causes.append(f"different code (commit {rc[:8]} vs {fc[:8]})")
    return causes


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
    if not any(m in run.metrics for m in EVAL_METRICS):
        c.notes.append("no eval metrics (evaluate has not run)")

    loss, ref_loss = run.series.get("loss", []), reference.series.get("loss", [])
    c.loss = series_diff(loss, ref_loss)
    c.grad_norm = series_diff(run.series.get("grad_norm", []), reference.series.get("grad_norm", []))
    c.causes = likely_causes(run, reference)
    if c.loss.common_steps == 0:
        c.status = NO_DATA
        c.verdict = "no per-step loss" if not loss else "no common steps"
        return c
    at_loss = first_divergence(loss, ref_loss, tol)
    at_norm = first_divergence(run.series.get("grad_norm", []), reference.series.get("grad_norm", []),
                               c.grad_norm_tolerance)
    if at_loss is not None and (at_norm is None or at_loss <= at_norm):
        c.first_divergent_step, c.first_divergent_metric = at_loss, "loss"
    elif at_norm is not None:
        c.first_divergent_step, c.first_divergent_metric = at_norm, "grad_norm"
    if c.step_mismatch:
        c.notes.append(f"{c.steps} optimizer steps, reference {c.reference_steps}")
    if c.first_divergent_step is not None:
        c.status, c.verdict = DIVERGED, f"diverged at step {c.first_divergent_step}" + (
            " (grad_norm)" if c.first_divergent_metric == "grad_norm" else "")
    elif c.step_mismatch:
        c.status = INCOMPLETE
        c.verdict = f"equal for {c.loss.common_steps} steps, then {c.steps} vs {c.reference_steps} steps"
    return c


def _sort_key(r: RunRecord):
    return (-(r.micro_batch or 0), r.accumulation or 0, r.checkpointing, r.start_time)


def compare_group(key: str, runs: list[RunRecord], overlaps: dict[str, list[str]] | None = None) -> GroupComparison:
    """Compare every run of one ``equivalence_key`` with the group's reference (:func:`choose_reference`);
    ``overlaps`` (:func:`find_overlaps`) marks runs whose speed and memory are not comparable."""
    ref = choose_reference(runs)
    others = sorted((r for r in runs if r is not ref), key=_sort_key)
    rows = [compare_run(ref, ref)] + [compare_run(r, ref) for r in others]
    for c in rows:
        c.overlaps = list((overlaps or {}).get(c.run.run_id, []))
        if c.overlaps:
            c.notes.append(f"trained at the same time as {', '.join(c.overlaps)} on the same machine: its "
                           "speed and memory are not comparable (train one at a time for timing, e.g. "
                           "`dvc queue start -j 1`)")
    g = GroupComparison(key=key, reference=ref, rows=rows)
    g.summary = summarize(g)
    return g


def compare(runs: list[RunRecord], others: list[RunRecord] = ()) -> Comparison:
    """Group ``runs`` by ``equivalence_key`` and compare each group. Groups with something to compare
    (two runs or more) come first, then single runs; within each, the most recently started first.
    ``others``: further training runs (not compared) whose windows count for :func:`find_overlaps`."""
    groups, skipped = group_by_key(runs)
    overlaps = find_overlaps(runs, others)
    out = [compare_group(k, rs, overlaps) for k, rs in groups.items()]
    out.sort(key=lambda g: (len(g.rows) < 2, -max(r.start_time for r in g.runs)))
    return Comparison(groups=out, skipped=skipped)


def _mib(b: float | None) -> str:
    return "?" if b is None else f"{b / 2**20:,.0f} MiB"


def summarize(g: GroupComparison) -> str:
    """A few sentences on one group: how many runs match the reference, the first divergence and its
    likely causes, and the cheapest equivalent run in memory and the fastest in samples per second."""
    ref = g.reference
    n = len(g.rows)
    head = f"{n} run{'s' if n != 1 else ''}; reference {ref.label} ({ref.split}, {ref.precision})."
    partial = sorted({p["step"] for c in g.rows for p in c.run.partial_steps})
    if partial:
        head += (f" Step{'s' if len(partial) > 1 else ''} {', '.join(map(str, partial))} saw fewer examples "
                 "than the effective batch (an epoch's short last step).")
    if n == 1:
        micro, eff = ref.micro_batch, ref.effective_batch
        other = next((m for m in ((micro or 0) // 2, (micro or 0) * 2) if m and eff and eff % m == 0), None)
        how = (f"`dvc exp run -S train.per_device_train_batch_size={other} "
               f"-S train.gradient_accumulation_steps={eff // other}`" if other else "another split")
        return head + f" Nothing to compare yet: train the same configuration as {how}, or with " \
                      f"`train.gradient_checkpointing` {'off' if ref.checkpointing else 'on'}."
    others = g.rows[1:]
    parts = [head]
    eq = [c for c in others if c.status == EQUIVALENT]
    div = [c for c in others if c.status == DIVERGED]
    if eq:
        parts.append(f"{len(eq)} of {len(others)} equivalent to it step by step "
                     f"(loss within {eq[0].tolerance.rtol:g} and grad_norm within "
                     f"{eq[0].grad_norm_tolerance.rtol:g} relative in {eq[0].precision}).")
    if div:
        first = min(div, key=lambda c: c.first_divergent_step)
        causes = sorted({cause.split(":")[0] for d in div for cause in d.causes})
        parts.append(f"{len(div)} diverged, the first at step {first.first_divergent_step} ({first.run.label})"
                     + (f"; likely causes: {'; '.join(causes)}." if causes else
                        "; no cause found in params or tags (check data order, seed and code)."))
    rest = [c for c in others if c.status in (INCOMPLETE, NO_DATA)]
    if rest:
        parts.append(f"{len(rest)} not comparable over all steps ({', '.join(c.run.label for c in rest)}).")
    overlapped = [c for c in g.rows if not c.cost_comparable]
    if overlapped:
        parts.append(f"Speed and memory not comparable for {', '.join(c.run.label for c in overlapped)}: "
                     "trained at the same time as other runs on one machine.")
    candidates = [c for c in [g.rows[0]] + eq if c.cost_comparable]
    mem = [c for c in candidates if c.run.peak_memory_bytes is not None]
    fast = [c for c in candidates if c.run.samples_per_second is not None]
    if len(candidates) > 1 and mem and fast:
        lo = min(mem, key=lambda c: c.run.peak_memory_bytes)
        hi = max(fast, key=lambda c: c.run.samples_per_second)
        parts.append(f"Among the equivalent runs, the least memory: {lo.run.split} "
                     f"({_mib(lo.run.peak_memory_bytes)}, {lo.run.samples_per_second:.1f} samples/s); "
                     f"the fastest: {hi.run.split} ({hi.run.samples_per_second:.1f} samples/s, "
                     f"{_mib(hi.run.peak_memory_bytes)}).")
    return " ".join(parts)
