"""``onegpu tradeoffs``' measurements: each variant's training run against the baseline's.

Per row (:func:`measure_row`): steady-state samples per second (optimizer steps 2..N, the recorder's
definition: :func:`onegpu.training.record.recorder.steady_samples_per_second`), peak memory (the CUDA allocator
peak on a GPU; on CPU the breakdown params + grads + optimizer states + one micro-batch's activations,
since the process RSS hides activation savings), time to the baseline's test loss, and the verdict:
same training, same within a precision's tolerance, or a different training (:mod:`onegpu.compare`
decides). Pure logic on plain records: no DVC, MLflow or torch here.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from onegpu.compare import DIVERGED, EQUIVALENT, REFERENCE, RunComparison, RunRecord, compare_run
from onegpu.compare.causes import DROPOUT
from onegpu.tradeoffs.knobs import PRECISION, Variant
from onegpu.training.record.recorder import steady_samples_per_second as steady_throughput

# Verdicts shown in the table.
SAME_TRAINING = "same training"
DIFFERENT_TRAINING = "different training"
# The same mathematics but other dropout masks (another split or kernel draws them differently): the
# runs agree in expectation, as two dropout seeds do; exact with model.dropout: 0.
IN_EXPECTATION = "same in expectation (other dropout masks)"

# What a row without a measured run says instead of a verdict. A row counts as measured when its training
# run finished (FINISHED, or SCHEDULED: trained, not evaluated, as a probe row that skips evaluate).
NOT_RUN = "not run"
STOPPED = "stopped"   # ended by Ctrl-C, SIGTERM, `dvc queue kill` / `dvc queue stop --kill` (MLflow: KILLED)
FAILED = "failed"     # its training raised (MLflow: FAILED)
RUNNING = "running"   # its training process is still writing steps
QUEUED = "queued"     # in the DVC queue, not started
UNMEASURED = (NOT_RUN, STOPPED, FAILED, RUNNING, QUEUED)
# MLflow run status -> the row's word
_RUN_STATUS = {"KILLED": STOPPED, "FAILED": FAILED}

# A step after the first slower than this many times the median step is named in the report's notes.
SLOW_STEP = 5.0


def compiled_by_step(r: RunRecord) -> dict[int, float]:
    """The seconds each optimizer step of ``r`` spent compiling (its ``step_compile_s`` series; {} for a run
    logged before it existed)."""
    return dict(r.series.get("step_compile_s", []))


def steady_samples_per_second(r: RunRecord) -> float | None:
    """Examples per second over the optimizer steps after the first that did not compile
    (:func:`onegpu.training.record.recorder.steady_samples_per_second` on the run's ``step_examples``,
    ``step_time_s`` and ``step_compile_s`` series: a row's warm-up is in none of its windows); the whole
    run's ``train_samples_per_second`` when the run has a single step or no per-step series."""
    examples, compiled = dict(r.series.get("step_examples", [])), compiled_by_step(r)
    rows = [{"step": s, "samples": examples[s], "step_time_s": t, "step_compile_s": compiled.get(s, 0.0)}
            for s, t in r.series.get("step_time_s", []) if s in examples]
    v = steady_throughput(rows)
    return v if v is not None else r.metrics.get("train_samples_per_second")


BREAKDOWN = ("mem_params_bytes", "mem_grads_bytes", "mem_optimizer_bytes", "mem_activation_bytes")


def memory_bytes(r: RunRecord) -> tuple[float | None, str]:
    """``(bytes, what)``: on a GPU the CUDA allocator peak (``train_mem_peak_bytes``); on CPU the sum of
    the breakdown params + grads + optimizer states + one micro-batch's saved activations + autocast's
    weight copies (bytes; the process RSS peak hides what checkpointing and precision save)."""
    if r.tags.get("device", "cpu").lower() != "cpu":
        return r.peak_memory_bytes, "allocator peak"
    parts = [r.metrics.get(k) for k in BREAKDOWN]
    if any(p is None for p in parts):
        return None, "breakdown"
    # + bf16/fp16 autocast's weight copies (real memory; runs logged before the split counted them as activations)
    return float(sum(parts) + r.metrics.get("mem_autocast_weights_bytes", 0.0)), "breakdown"


@dataclass
class Row:
    """One variant measured against the baseline (ratios > 1: faster / more memory)."""
    variant: Variant
    run: RunRecord | None
    samples_per_second: float | None = None
    speedup: float | None = None
    memory_bytes: float | None = None
    memory_ratio: float | None = None
    memory_kind: str = ""
    first_step_s: float | None = None
    compile_s: float = 0.0  # seconds its steps spent compiling (``step_compile_s``): warm-up, in no window
    train_runtime_s: float | None = None
    test_loss: float | None = None
    time_to_test_loss_s: float | None = None
    verdict: str = NOT_RUN
    # the row's repeats (``--repeats``): how many were measured, and the min-max of their samples/s ratios
    # to the baseline of their own round (for the baseline: its samples/s over its median)
    repeats: int = 1
    speedup_range: tuple[float, float] | None = None
    ratios: tuple[float, ...] = ()  # each repeat's ratio (with several repeats; one: ``speedup`` alone)
    # fit for the recommendation: same key and within fp32 (or tf32) tolerance, or apart only by dropout masks
    same_training: bool = False
    comparison: RunComparison | None = None
    notes: list[str] = field(default_factory=list)


def _reached(loss: float | None, target: float | None, rtol: float, atol: float) -> bool:
    """``loss`` at most ``target``, or within the tolerance of it (``numpy.isclose``, reference ``target``)."""
    return loss is not None and target is not None and bool(
        loss <= target or np.isclose(loss, target, rtol=rtol, atol=atol))


def _verdict(v: Variant, c: RunComparison, same_key: bool) -> tuple[str, bool]:
    """The verdict text of a compared run and whether it keeps the same training (exactly, within
    tf32's tolerance, or up to dropout masks: :data:`IN_EXPECTATION`)."""
    where = f" at step {c.first_divergent_step}" if c.first_divergent_step else ""
    if not same_key and v.expect != PRECISION:  # another optimizer, LoRA: another key
        return DIFFERENT_TRAINING, False
    if c.status == EQUIVALENT:
        if same_key and c.precision in ("fp32", "tf32"):
            return (SAME_TRAINING if c.precision == "fp32" else "same within tf32 tolerance"), True
        return f"same within {c.precision} tolerance", False
    if not same_key:
        return f"differs beyond {c.precision} tolerance{where}", False
    if c.status == DIVERGED and any(x.startswith(DROPOUT) for x in c.causes):
        return IN_EXPECTATION, True
    if c.status == DIVERGED:
        return f"diverged{where}" + (f": {c.causes[0]}" if c.causes else ""), False
    return c.verdict, False  # incomplete or no data


def unmeasured(run: RunRecord | None, state: str | None = None) -> str | None:
    """Why ``run`` (a row's latest training run, None: none in the store) is not a measurement, as one of
    :data:`UNMEASURED`, or None when it is one; ``state``: the row's ``dvc queue status`` word, if any."""
    if run is not None and run.status not in _RUN_STATUS and "train_runtime" in run.metrics:
        return None  # its training finished (even when the command was stopped after it)
    if state == "Stopped":  # stopped by this command (Ctrl-C, SIGTERM) before or while it trained
        return STOPPED
    if run is None:  # DVC's Failed: the task ended before its training opened a run (killed, or a stage failed)
        return {"Queued": QUEUED, "Running": RUNNING, "Failed": f"{STOPPED} or {FAILED} before training (dvc queue: "
                "Failed)"}.get(state or "", NOT_RUN)
    if run.status in _RUN_STATUS:
        return _RUN_STATUS[run.status]
    return RUNNING if run.status == "RUNNING" else STOPPED  # no train-end summary


def _step_notes(times: dict[int, float], compiled: dict[int, float]) -> list[str]:
    """The notes on a run's steps after the first: those that compiled (left out of its samples/s), and
    those slower than :data:`SLOW_STEP` times the median of the others without compiling (counted)."""
    notes = []
    warm = [(s, times[s], c) for s, c in sorted(compiled.items()) if s >= 2 and c > 0 and s in times]
    if warm:  # torch.compile recompiling for a new shape (an epoch's short last step), torchao's step
        notes.append("optimizer step " + ", ".join(f"{s} compiled ({c:.1f} s of its {t:.1f} s)" for s, t, c in warm)
                     + ": warm-up, left out of its samples/s")
    later = sorted(v for s, v in times.items() if s >= 2 and not compiled.get(s))
    if later:
        typical = later[len(later) // 2]
        slow = [(s, v) for s, v in sorted(times.items()) if s >= 2 and not compiled.get(s) and v > SLOW_STEP * typical]
        if slow:
            notes.append("optimizer step " + ", ".join(f"{s} took {v:.1f} s" for s, v in slow)
                         + f" against a median {typical:.2f} s without compiling (a one-off stall); its samples/s "
                           "count them")
    return notes


def measure_row(v: Variant, run: RunRecord | None, baseline: RunRecord | None, state: str | None = None) -> Row:
    """Measure ``run`` (the variant's training run, None when it has not run) against ``baseline``; a run
    that did not finish its training is no measurement: the row says why (:func:`unmeasured`)."""
    row = Row(variant=v, run=run)
    if (why := unmeasured(run, state)) is not None:
        row.run, row.verdict = None, why
        return row
    row.samples_per_second = steady_samples_per_second(run)
    row.memory_bytes, row.memory_kind = memory_bytes(run)
    times = dict(run.series.get("step_time_s", []))
    row.first_step_s = times.get(1)
    compiled = compiled_by_step(run)
    row.compile_s = sum(compiled.values())
    row.notes.extend(_step_notes(times, compiled))
    row.train_runtime_s = run.metrics.get("train_runtime")
    row.test_loss = run.metrics.get("test_loss")
    if baseline is None:
        return row
    base_sps = steady_samples_per_second(baseline)
    base_mem, _ = memory_bytes(baseline)
    row.speedup = row.samples_per_second / base_sps if row.samples_per_second and base_sps else None
    row.memory_ratio = row.memory_bytes / base_mem if row.memory_bytes and base_mem else None
    c = compare_run(run, baseline)
    row.comparison = c
    if run is baseline or c.status == REFERENCE:
        row.verdict, row.same_training = "baseline", True
    else:
        row.verdict, row.same_training = _verdict(v, c, run.key is not None and run.key == baseline.key)
        row.notes.extend(c.notes)
    # Time to the baseline's test loss: the training time when the run's final test loss is at least as
    # good (within its precision's tolerance); test loss is measured once, after training.
    tol = c.tolerance
    if _reached(row.test_loss, baseline.metrics.get("test_loss"), tol.rtol, tol.atol):
        row.time_to_test_loss_s = row.train_runtime_s
    return row


def failed(row: Row) -> bool:
    """Whether ``row``'s training failed (all its repeats, or one after others were measured)."""
    return row.verdict == FAILED or row.verdict.endswith(f", then {FAILED}")


def repeat_name(name: str, r: int) -> str:
    """Row ``name``'s ``r``-th repeat (1-based): ``name`` itself, then ``name-r2``, ``name-r3``, ..."""
    return name if r == 1 else f"{name}-r{r}"


def aggregate(v: Variant, rows: list[Row]) -> Row:
    """One row from its repeats (``rows``, each against the baseline of its own round): the medians of
    samples/s, speed-up, memory and times, the min-max of the speed-ups, the verdict of the first repeat
    unless another is not the same training (the worst one shows). A row with an unmeasured repeat is
    unmeasured: the first such repeat's word (e.g. stopped), after how many repeats were measured when
    some were ("1 of 3 repeats measured, then not run")."""
    missing = [r for r in rows if r.run is None]
    if missing:  # no measurement; with some repeats measured it says how many, never only "not run"
        done = len(rows) - len(missing)
        word = f"{done} of {len(rows)} repeats measured, then {missing[0].verdict}" if done else missing[0].verdict
        out = Row(variant=v, run=None, verdict=word)
        out.notes = [f"{done} of {len(rows)} repeats measured"] if len(rows) > 1 else []
        return out
    if len(rows) == 1:
        return rows[0]
    first = rows[0]
    med = lambda xs: float(np.median(xs)) if xs and None not in xs else None  # noqa: E731
    out = Row(variant=v, run=first.run, comparison=first.comparison, memory_kind=first.memory_kind,
              repeats=len(rows))
    for attr in ("samples_per_second", "speedup", "memory_bytes", "memory_ratio", "first_step_s",
                 "train_runtime_s", "test_loss", "time_to_test_loss_s"):
        setattr(out, attr, med([getattr(r, attr) for r in rows]))
    out.compile_s = sum(r.compile_s for r in rows)  # a cost paid, not a rate: summed
    worst = next((r for r in rows if not r.same_training), first)
    out.verdict, out.same_training = worst.verdict, all(r.same_training for r in rows)
    ups = [r.speedup for r in rows]
    if v.knob == "baseline":
        sps = [r.samples_per_second for r in rows]
        ups = [x / out.samples_per_second for x in sps] if None not in sps and out.samples_per_second else [None]
    out.speedup_range = (min(ups), max(ups)) if None not in ups else None
    out.ratios = tuple(ups) if None not in ups else ()
    out.notes = list(dict.fromkeys(n for r in rows for n in r.notes))
    return out


def measure_rows(variants: list[Variant], runs: dict[str, RunRecord], repeats: int | dict[str, int] = 1,
                 states: dict[str, str] | None = None) -> list[Row]:
    """One :class:`Row` per variant over its ``repeats`` (one count for every row, or each row's own by
    name: a row decided after fewer windows, :mod:`onegpu.tradeoffs.windows`): ``runs`` maps a repeat's
    name (:func:`repeat_name`) to its training run (absent: not run), ``states`` to its DVC queue state;
    repeat ``r`` of each variant is measured against repeat ``r`` of the baseline (the same round)."""
    states = states or {}
    out = []
    for v in variants:
        n = repeats if isinstance(repeats, int) else repeats.get(v.name, 1)
        rows = [measure_row(v, runs.get(repeat_name(v.name, r)), runs.get(repeat_name("baseline", r)),
                            states.get(repeat_name(v.name, r))) for r in range(1, n + 1)]
        out.append(aggregate(v, rows))
    return out
