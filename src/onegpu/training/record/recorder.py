"""Per-optimizer-step measurement, backend-neutral: time, memory, samples and tokens, plus the backend's loss;
the terminal's progress line per step and closing line per run.

Host-device syncs: one per optimizer step (to time the step and read its token count), none per
micro-batch. Metrics go to a ``sink(metrics: dict, step: int)`` (the stage passes a batched MLflow
writer), so this module knows nothing of MLflow, and it imports no backend: each backend feeds the
recorder from its own loop or callbacks (:mod:`onegpu.training.backends`).
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable

from onegpu.config import TORCHAO_OPTIMIZERS
from onegpu.errors import UserError
from onegpu.formatting import duration, gib, mib
from onegpu.measure import compilation, memory
from onegpu.training.lifecycle import interrupt


class TrainingDiverged(UserError):
    """The loss of an optimizer step is NaN or infinite: training stops at that step."""

    def __init__(self, step: int, loss: float, learning_rate: float | None) -> None:
        super().__init__(
            f"the loss is {loss} at optimizer step {step}; training stopped there. Likely causes: a learning "
            f"rate too high (train.learning_rate, {learning_rate} at that step; try 10x lower or add "
            "train.warmup_ratio), fp16 overflow (use bf16 or fp32), or bad rows in the data")
        self.step = step


class BatchCounter:
    """Counts examples, non-padding tokens, loss targets and squared lengths of the micro-batches fed to
    the model.

    ``add`` keeps the counts on the device (no sync); ``take`` reads and resets them once per step.
    Targets are what the loss averages over: the examples of a classifier (1-D labels,
    :func:`onegpu.training.objectives.loss.count_examples`), the shifted target tokens of a causal LM (2-D labels,
    :func:`onegpu.training.objectives.loss.count_targets`).
    """

    def __init__(self, sequences_per_example: int = 1) -> None:
        # Sequences an example puts through the model: 2 for a preference pair (its chosen and rejected answer).
        self.per_example = sequences_per_example
        self.samples = 0
        # device tensor: (tokens, targets, sum of squared non-padding lengths, sequences in flattened rows)
        self._counts = None

    def add(self, inputs: dict) -> None:
        """Count one micro-batch (on its device). A padding-free row (``position_ids``, no attention mask,
        :class:`onegpu.training.objectives.batches.PaddingFreeCollator`) holds one example per position 0, and
        ``sum(2 p + 1)`` over its positions is the sum of its sequences' squared lengths."""
        import torch

        from onegpu.training.objectives.loss import count_examples, count_targets
        ids = inputs["input_ids"]
        mask, positions = inputs.get("attention_mask"), inputs.get("position_ids")
        flat = mask is None and positions is not None
        if flat:
            positions = positions.to(torch.int64)
            lengths = torch.full((ids.shape[0],), ids.shape[-1], device=ids.device, dtype=torch.int64)
            squares, sequences = (2 * positions + 1).sum(), positions.eq(0).sum()
        else:
            self.samples += int(ids.shape[0])
            lengths = (mask.sum(dim=-1) if mask is not None else torch.full(
                (ids.shape[0],), ids.shape[-1], device=ids.device)).to(torch.int64)
            squares, sequences = (lengths * lengths).sum(), torch.zeros((), dtype=torch.int64, device=ids.device)
        labels = inputs.get("labels")
        if labels is None:
            targets = torch.tensor(ids.shape[0], device=ids.device)
        else:
            targets = count_targets(labels) if labels.dim() > 1 else count_examples(labels)  # tokens or rows
        n = torch.stack([lengths.sum(), targets.to(lengths.device, torch.int64), squares, sequences])
        self._counts = n if self._counts is None else self._counts + n

    def take_all(self) -> tuple[int, int, int, int]:
        """(examples (pairs for preference data), non-padding tokens, loss targets, sum of squared non-padding
        lengths) since the last take; one host sync."""
        counts = self._counts.tolist() if self._counts is not None else [0, 0, 0, 0]
        s = (self.samples + int(counts[3])) // self.per_example
        self.samples, self._counts = 0, None
        return s, int(counts[0]), int(counts[1]), int(counts[2])


# Per-step item counts logged with each optimizer step (MLflow metrics): examples, non-padding tokens
# and loss targets (examples of a classifier, shifted target tokens of a causal LM) of that step.
ITEM_COUNTS = {"samples": "step_examples", "tokens": "step_tokens", "targets": "step_targets"}
INTERNAL = ("step", "tokens_sq")


def step_metrics(row: dict) -> dict:
    """The MLflow metrics of one recorded step: its measurements plus the item counts under their
    metric names (``step_examples``, ``step_tokens``, ``step_targets``)."""
    out = {}
    for k, v in row.items():
        if k in INTERNAL:
            continue
        out[ITEM_COUNTS.get(k, k)] = v
    return out


class StepRecorder:
    """Backend-neutral per-optimizer-step measurement. Per step (MLflow step = optimizer step, from 1):

    ``loss``, ``grad_norm``, ``learning_rate`` (given by the backend), ``step_time_s`` (wall seconds
    since the previous step ended, data loading and all micro-batches included), ``samples_per_second``,
    ``tokens_per_second`` (non-padding tokens), ``mem_peak_bytes`` (see :mod:`onegpu.measure.memory`),
    ``step_compile_s`` (seconds of it spent compiling: ``torch.compile``, torchao's optimizer step;
    :mod:`onegpu.measure.compilation`; > 0 marks a warm-up step, left out of the steady figures), and the
    step's item counts ``step_examples``, ``step_tokens``, ``step_targets`` (:data:`ITEM_COUNTS`).
    Rows are kept in ``self.rows`` for plots and the summary; each is also sent to ``sink``.

    Use: ``start()`` before the first step; ``end_step(step)`` right after each optimizer step;
    ``log(step, loss, grad_norm, learning_rate)`` once the backend has those numbers.
    """

    def __init__(self, sink: Callable[[dict, int], None], device, counter: BatchCounter) -> None:
        self.sink, self.device, self.counter = sink, device, counter
        self.rows: list[dict] = []
        self.breakdown: dict[str, int] = {}   # the memory breakdown, logged once per run
        self.events: list[dict] = []          # out-of-memory recoveries: step, old and new split
        self._pending: dict[int, dict] = {}
        self._watch = None
        self._compiled = None
        self._cuda_peaks: dict[str, int] = {}
        # The training window, wall-clock seconds since the epoch: start of the first step this process
        # ran to the end of its last one (``onegpu compare`` flags runs whose windows overlap).
        self.window_start: float | None = None
        self.window_end: float | None = None
        self._wall_start: float | None = None
        # Validation during training (onegpu.training.validation.Validation), run by log() after a step's
        # own metrics; None: none. Its points, ``{"step": N, "eval_loss": ..., ...}`` in step order, are kept
        # with the rows (a checkpoint holds them; a resumed run continues them).
        self.validation = None
        # The objective's own per-step metrics (Objective.step_figures: DPO's rewards/*), taken by log(); None: none.
        self.figures = None
        # The objective's tables (artifact -> column -> values: GRPO's sampled completions), its live dicts: the
        # checkpoints keep them and a resume refills them in place (Objective.run_tables).
        self.tables: dict[str, dict[str, list]] = {}
        self.evals: list[dict] = []
        self.stopped_early: str | None = None  # early stopping's sentence, once it stopped the run
        self.best: dict | None = None  # the validation point whose weights the model holds (load_best_model_at_end)

    def restore(self, point) -> None:
        """Continue from a checkpoint: its step rows, validation points, tables, memory breakdown and out-of-memory
        events (``point``: a :class:`onegpu.training.lifecycle.resume.ResumePoint`)."""
        self.rows = list(point.rows)
        self.evals = list(point.evals)
        for name, columns in point.tables.items():  # in place: the objective appends to these dicts
            live = self.tables.setdefault(name, {})
            live.clear()
            live.update({k: list(v) for k, v in columns.items()})
        self.breakdown.update(point.breakdown)
        self.events.extend(point.events)

    def probe_activations(self, model, batch: dict, loss_fn) -> None:
        """Record ``mem_activation_bytes`` for one micro-batch and ``mem_autocast_weights_bytes`` (the
        bf16/fp16 weight copies autocast keeps for backward; 0 in fp32): :func:`onegpu.measure.memory.saved_bytes`."""
        saved = memory.saved_bytes(model, batch, loss_fn)
        self.breakdown["mem_activation_bytes"] = saved["activations"]
        self.breakdown[memory.AUTOCAST_WEIGHTS] = saved["autocast_weights"]

    def record_states(self, model, optimizer) -> None:
        """Record params/grads/optimizer bytes once, right after the first optimizer step."""
        if "mem_optimizer_bytes" not in self.breakdown:
            self.breakdown.update(memory.state_bytes(model, optimizer))

    def start(self) -> None:
        memory.synchronize(self.device)
        memory.reset_peak(self.device)
        self._watch = memory.Stopwatch()
        self._compiled = compilation.Compilations()
        self._wall_start = time.time()
        self.counter.take_all()

    def end_step(self, step: int) -> None:
        memory.synchronize(self.device)
        dt = self._watch.lap()
        compiled = self._compiled.lap()
        samples, tokens, targets, tokens_sq = self.counter.take_all()
        if self.window_start is None:
            self.window_start = self._wall_start
        self.window_end = time.time()
        peak = memory.peak_bytes(self.device)
        self._pending[step] = _whole_step(dt, samples, tokens, targets, tokens_sq, peak, compiled, self.device)
        for k, v in memory.cuda_peaks(self.device).items():
            self._cuda_peaks[k] = max(v, self._cuda_peaks.get(k, 0))
        memory.reset_peak(self.device)

    def log(self, step: int, loss: float, grad_norm: float | None, learning_rate: float | None) -> None:
        row = self._pending.pop(step, None)
        if row is None:
            return
        row.update(loss=loss, grad_norm=grad_norm, learning_rate=learning_rate)
        if self.figures is not None:  # the objective's own (DPO's rewards/*), over the whole step
            row.update(self.figures())
        self.rows.append({"step": step, **row})
        self.sink(step_metrics(row), step)
        if not math.isfinite(loss):
            raise TrainingDiverged(step, loss, learning_rate)
        if self.validation is not None and self.validation.is_point(step):
            metrics = self._between_steps(self.validation, step)
            self.evals.append({"step": step, **metrics})
            self.sink(metrics, step)
        if self.validation is not None:
            self.stopped_early = self.validation.after(step, self.evals)

    def _between_steps(self, validate, step: int) -> dict:
        """``validate(step)``'s metrics between two optimizer steps, kept out of both: its peak memory is its
        own (``eval_mem_peak_bytes``, next to its ``eval_runtime``), and the next step's time and peak
        start after it (the steps' speed, MFU and memory are the training's alone)."""
        memory.synchronize(self.device)
        memory.reset_peak(self.device)
        with interrupt.validating(step):  # a signal now: the run stops after the pass, at this step
            metrics = validate(step)
        memory.synchronize(self.device)
        metrics["eval_mem_peak_bytes"] = memory.peak_bytes(self.device)
        if not memory.is_cuda(self.device):  # the pass's freed host blocks out of the next steps' RSS peaks
            from onegpu.training.memory import host_allocator
            host_allocator.release()
        if self._watch is not None:
            self._watch.lap()
            self._compiled.lap()
        memory.reset_peak(self.device)
        return metrics

    def memory(self) -> dict[str, int]:
        """The breakdown plus run peaks: ``mem_allocated_peak_bytes``/``mem_reserved_peak_bytes`` (CUDA,
        max over steps) and ``mem_rss_peak_bytes`` (process peak RSS over the steps, any device); with
        ``train.load_best_model_at_end``, ``mem_best_model_bytes``: the best point's weights, kept on disk,
        not in device memory (:meth:`onegpu.training.validation.Validation._save_best`)."""
        out = dict(self.breakdown)
        out.update(self._cuda_peaks)
        rss = memory.rss_peak_bytes()
        if not memory.is_cuda(self.device) and self.rows:
            rss = max(rss, max(r["mem_peak_bytes"] for r in self.rows))
        out["mem_rss_peak_bytes"] = rss
        if self.validation is not None and self.validation.best_bytes:  # train.load_best_model_at_end: on disk
            out["mem_best_model_bytes"] = self.validation.best_bytes
        return out

    def partial_steps(self, effective_batch: int) -> list[dict]:
        """Optimizer steps that saw fewer examples than ``effective_batch`` (an epoch's short last step:
        100 rows at 16 per step end with a step of 4): ``[{"step", "examples", "effective_batch"}]``."""
        return [{"step": r["step"], "examples": r["samples"], "effective_batch": effective_batch}
                for r in self.rows if r["samples"] < effective_batch]

    def tokens_sq(self) -> int | None:
        """Sum over the trained examples of their squared non-padding length (the attention term of
        :func:`onegpu.measure.flops.train_flops`); None when a step has no count (rows from an older checkpoint)."""
        if not self.rows or any("tokens_sq" not in r for r in self.rows):
            return None
        return sum(r["tokens_sq"] for r in self.rows)

    def summary(self) -> dict:
        """Totals over the logged steps: train_loss (mean step loss, as HF's), runtime and throughput."""
        if not self.rows:
            return {}
        runtime = sum(r["step_time_s"] for r in self.rows)
        samples = sum(r["samples"] for r in self.rows)
        tokens = sum(r["tokens"] for r in self.rows)
        return {
            "train_loss": sum(r["loss"] for r in self.rows) / len(self.rows),
            "train_runtime": runtime,
            "train_samples_per_second": samples / runtime if runtime else 0.0,
            "train_tokens_per_second": tokens / runtime if runtime else 0.0,
            "train_mem_peak_bytes": max(r["mem_peak_bytes"] for r in self.rows),
            "train_steps": len(self.rows), "train_samples": samples, "train_tokens": tokens,
        }


def warm_up(row: dict) -> bool:
    """Whether an optimizer step's row (the recorder's, or one rebuilt from the logged series) holds warm-up:
    step 1 (allocator growth, the activation probe, a kernel's first call) or any step that compiled
    (``step_compile_s`` > 0: ``torch.compile``'s first graph, a recompilation for a new shape, torchao's
    optimizer step)."""
    return row["step"] < 2 or (row.get("step_compile_s") or 0.0) > 0.0


def steady_samples_per_second(rows) -> float | None:
    """Steady-state throughput, examples per second: the steps that are not :func:`warm_up` (step 1 and any
    step that compiled), their examples over their wall time.

    ``rows``: the recorder's rows (``step``, ``samples``, ``step_time_s``, ``step_compile_s``), or rows of the
    same keys rebuilt from the logged ``step_examples``, ``step_time_s`` and ``step_compile_s`` series (runs
    logged before ``step_compile_s`` existed: step 1 alone is warm-up). None when no steady step has a time."""
    keep = [r for r in rows if not warm_up(r)]
    total = sum(r["step_time_s"] for r in keep)
    return sum(r["samples"] for r in keep) / total if total > 0 else None


def _whole_step(dt: float, samples: int, tokens: int, targets: int, tokens_sq: int, peak: int, compiled: float,
                device) -> dict:
    """The step's row over all processes (one all-gather under several; this process's values alone).

    Counts are summed over ranks; ``step_time_s`` is the slowest rank's (they wait for each other at the
    gradient all-reduce); ``samples_per_second``/``tokens_per_second`` = the step's examples/tokens over
    all ranks divided by it; ``mem_peak_bytes`` = the largest rank's; ``step_compile_s`` the largest rank's
    compile seconds (one rank compiling holds the others at the next collective). Under several processes each rank's
    own ``step_time_s``, ``samples_per_second``, ``tokens_per_second`` and ``mem_peak_bytes`` are added
    as ``<name>.rank<r>``.
    """
    from onegpu.training.parallel import distributed
    ranks = distributed.gather_over_ranks([dt, samples, tokens, targets, tokens_sq, peak, compiled], device)
    step_time = max(r[0] for r in ranks)
    total = [int(sum(r[i] for r in ranks)) for i in range(1, 5)]
    row = {
        "step_time_s": step_time,
        "samples_per_second": total[0] / step_time if step_time > 0 else 0.0,
        "tokens_per_second": total[1] / step_time if step_time > 0 else 0.0,
        "mem_peak_bytes": int(max(r[5] for r in ranks)),
        "step_compile_s": max(r[6] for r in ranks),
        "samples": total[0], "tokens": total[1], "targets": total[2], "tokens_sq": total[3],
    }
    if len(ranks) > 1:
        for i, (r_dt, r_samples, r_tokens, _, _, r_peak, _) in enumerate(ranks):
            row[f"step_time_s.rank{i}"] = r_dt
            row[f"samples_per_second.rank{i}"] = r_samples / r_dt if r_dt > 0 else 0.0
            row[f"tokens_per_second.rank{i}"] = r_tokens / r_dt if r_dt > 0 else 0.0
            row[f"mem_peak_bytes.rank{i}"] = int(r_peak)
    return row


def progress_line(step: int, total: int, rows: list[dict], device, evals: list[dict] | None = None) -> str:
    """The terminal line for optimizer step ``step`` of ``total``, from the recorder's ``rows`` (the last is
    this step's): loss, throughput over the last row, step time, peak memory and the time left.

    Example: ``step 20/32 | loss 1.2034 | eval_loss 1.3120 (step 16) | 41.3 samples/s | 0.39 s/step | peak 1.69 GiB
    RSS | 5 s left`` (the latest validation point, ``evals``, when there is one: its first of
    :data:`PROGRESS_EVALS`).
    Memory is the step's peak: the CUDA allocator's on a GPU, the process RSS on a CPU (:mod:`onegpu.measure.memory`).
    Time left: mean step time of this process's rows after its first that did not compile (warm-up, as in
    :func:`steady_samples_per_second`: compilation, such as torchao's optimizer step) x steps to go; of the
    rows after the first when each compiled; the first row's when it is the only one.
    """
    row = rows[-1]
    where = "allocated" if memory.is_cuda(device) else "RSS"
    steady = [r for r in rows[1:] if not warm_up(r)] or rows[1:] or rows
    mean = sum(r["step_time_s"] for r in steady) / len(steady)
    left = max(total - step, 0) * mean
    shown = next((k for k in PROGRESS_EVALS if evals and k in evals[-1]), None)  # (GRPO's: a pass rate)
    latest = f" | {shown} {evals[-1][shown]:.4f} (step {evals[-1]['step']})" if shown else ""
    return (f"step {step}/{total} | loss {row['loss']:.4f}{latest} | {row.get('samples_per_second', 0):.1f} "
            f"samples/s | {row['step_time_s']:.2f} s/step | peak {gib(row.get('mem_peak_bytes', 0))} {where} | "
            f"{duration(left)} left")


PROGRESS_EVALS = ("eval_loss", "eval_pass_rate")  # the validation figure a progress line shows, the first there is


def first_step_note(optim) -> str | None:
    """The terminal line before the first step for an optimizer that compiles its step on first use
    (``train.optim`` in :data:`onegpu.config.TORCHAO_OPTIMIZERS`: torchao's ``torch.compile``, once per
    parameter shape), else None. ``optim``: the name, or transformers' ``OptimizerNames`` member."""
    name = getattr(optim, "value", optim)
    if name not in TORCHAO_OPTIMIZERS:
        return None
    return (f"{name}: torchao compiles its optimizer step during step 1 (tens of seconds on a CPU); "
            "the time left and the steady-state throughput leave out the steps that compile")


def closing_line(summary: dict, layout, device: str, budget: int | None, run_id: str,
                 items: str = "examples") -> str:
    """The train stage's last line: optimizer steps, the batch layout (a :class:`onegpu.config.Resolved`),
    ``train_loss``, time, peak memory (:func:`peak_text`), device and MLflow run, from the recorder's
    ``summary`` (:meth:`StepRecorder.summary`); ``budget``: the ``auto`` budget in bytes, or None; ``items``: what
    a step holds (the objective's :meth:`~onegpu.training.objectives.base.Objective.start_words`)."""
    r = layout
    return (f"train: {summary.get('train_steps', 0)} optimizer steps of {r.effective_batch_size} {items} "
            f"({r.per_device_train_batch_size} x {r.gradient_accumulation_steps}"
            f"{f' x {r.world_size} processes' if r.world_size > 1 else ''}), "
            f"train_loss {summary.get('train_loss', float('nan')):.4f}, {summary.get('train_runtime', 0):.1f} s, "
            f"{peak_text(summary.get('train_mem_peak_bytes', 0), device, budget)} "
            f"on {memory.device_name(device)}; MLflow run {run_id}")


def peak_text(peak: int, device: str, budget: int | None) -> str:
    """The peak memory for the closing line, saying what it measures. On a CPU it is the process RSS,
    which holds the Python runtime, the libraries and the data besides the training state, so it
    exceeds an ``auto`` budget (which covers the probed training state only)."""
    if memory.is_cuda(device):
        return f"peak {mib(peak)} allocated"
    text = f"peak {mib(peak)} process RSS"
    if budget is not None:
        text += (f" (the auto budget, {gib(budget)}, covers the probed training state only; RSS "
                 "also holds the Python runtime, libraries and data)")
    return text
