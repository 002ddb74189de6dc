"""The single-GPU guide's table, measured: one DVC experiment per efficiency knob, and what each costs.

Pure logic, no DVC or MLflow here (``onegpu.stages.tradeoffs`` queues the experiments and reads the runs):

* :func:`plan`: from the user's params, the baseline plus one variant per knob that applies (a split of
  the same effective batch, activation checkpointing, mixed precision, TF32, an optimizer swap, the
  attention kernel, ``torch.compile``, the CPU host allocator, LoRA), each as the ``-S`` overrides of
  a ``dvc exp run``;
* :func:`measure_rows`: each variant's run against the baseline's: steady-state samples per second
  (optimizer steps 2..N), peak memory (the CUDA allocator peak on a GPU; on CPU the breakdown params +
  grads + optimizer states + one micro-batch's activations, since the process RSS hides activation
  savings), time to the baseline's eval loss, and the verdict: same training, same within a precision's
  tolerance, or a different training (:mod:`onegpu.equivalence` decides);
* :func:`recommend`: the fastest configuration that keeps the same training and fits the memory budget,
  combined from the knobs that were measurably faster on their own.

The guide: "Methods and tools for efficient training on a single GPU", Hugging Face transformers docs
(perf_train_gpu_one).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from onegpu.config import Config
from onegpu.equivalence import DIVERGED, EQUIVALENT, INCOMPLETE, REFERENCE, RunComparison, RunRecord, compare_run

# What the equivalence key says of a variant before it runs.
SAME = "same"            # same key: the same mathematics (split, recompute, kernel)
PRECISION = "precision"  # the same mathematics in lower precision: compared within its tolerance
DIFFERENT = "different"  # another training (optimizer, LoRA): another key

# Verdicts shown in the table.
SAME_TRAINING = "same training"
DIFFERENT_TRAINING = "different training"
# The same mathematics but other dropout masks (another split or kernel draws them differently): the
# runs agree in expectation, as two dropout seeds do; exact with model.dropout: 0.
IN_EXPECTATION = "same in expectation (other dropout masks)"

# A variant counts as faster only when its steady-state samples/s beat the baseline's by this share:
# identical runs on a small shared CPU differ by several percent (bench/README.md, "Reading these numbers").
MIN_GAIN = 0.05

# A step after the first slower than this many times the median step is named in the report's notes.
SLOW_STEP = 5.0

# The LoRA row's -S when the user's params train the whole model (model.lora.r: 0): rank 8, peft's usual
# start; params.yaml's alpha 16, dropout 0, target_modules null. LORA_MAPPING: the same for a params file
# whose model.lora is null (which DVC cannot set a dotted key in).
LORA_ROW = (("model.lora.r", "8"),)
LORA_MAPPING = "{r: 8, alpha: 16, dropout: 0.0, target_modules: null}"

# The knob names, in the guide's order; `--knobs` takes these.
KNOBS = ("split", "checkpointing", "precision", "tf32", "optimizer", "attention", "compile", "allocator",
         "lora")


@dataclass(frozen=True)
class Variant:
    """One experiment of the table.

    Attributes:
        name: suffix of the DVC experiment name and the row's label (``baseline``, ``split-16x1``, ``bf16``).
        knob: which of :data:`KNOBS` it measures (``baseline`` for the baseline, ``recommended``).
        overrides: ``("section.key", "value")`` pairs, as ``dvc exp run -S section.key=value`` takes them.
        expect: :data:`SAME`, :data:`PRECISION` or :data:`DIFFERENT`: what the equivalence key predicts.
        what: the change in words, for the table.
    """
    name: str
    knob: str
    overrides: tuple[tuple[str, str], ...]
    expect: str
    what: str

    @property
    def set_args(self) -> list[str]:
        """``["-S", "key=value", ...]`` for ``dvc exp run``."""
        return [a for k, v in self.overrides for a in ("-S", f"{k}={v}")]

    @property
    def set_text(self) -> str:
        """The overrides as one could paste them after ``dvc exp run``: ``-S 'key=value' ...``."""
        return " ".join(f"-S '{k}={v}'" for k, v in self.overrides)


def _yaml(v: bool) -> str:
    return "true" if v else "false"


def with_overrides(variants: list[Variant], common: list[tuple[str, str]]) -> list[Variant]:
    """Every variant with ``common`` (``tradeoffs -S key=value``) before its own overrides (its own win
    on the same key: ``dvc exp run -S`` applies them in order)."""
    if not common:
        return variants
    return [Variant(v.name, v.knob, (*tuple(common), *v.overrides), v.expect, v.what) for v in variants]


def plan(cfg: Config, cuda: bool = False, bf16_supported: bool = True, bnb_available: bool = False,
         knobs: tuple[str, ...] = KNOBS) -> tuple[list[Variant], list[str]]:
    """The baseline and one variant per applicable knob of ``knobs`` (:data:`KNOBS`).

    Args:
        cfg: the user's params (the baseline).
        cuda: a CUDA GPU is visible (TF32, fp16 and the 8-bit optimizer apply only there).
        bf16_supported: the GPU supports bf16 (else mixed precision means fp16); ignored on CPU.
        bnb_available: bitsandbytes is installed (adds the 8-bit AdamW row on CUDA).
        knobs: the subset to plan.
    Returns:
        ``(variants, skipped)``: the baseline first, then the variants in the guide's order; ``skipped``
        says for each left-out knob why.
    """
    t, m = cfg.train, cfg.model
    out = [Variant("baseline", "baseline", (), SAME, "your params.yaml")]
    skipped = []

    if "split" in knobs:
        micro, accum = t.per_device_train_batch_size, t.gradient_accumulation_steps
        if micro == "auto":
            skipped.append("split: the micro-batch is `auto` (the finder picks the largest that fits)")
        else:
            micro = int(micro)
            if accum % 2 == 0:
                split = (micro * 2, accum // 2, "a larger micro-batch, fewer accumulated micro-batches")
            elif micro % 2 == 0:
                split = (micro // 2, accum * 2, "a smaller micro-batch, more accumulated micro-batches")
            else:
                split = None
                skipped.append(f"split: {micro} x {accum} has no other split by 2")
            if split:
                out.append(Variant(f"split-{split[0]}x{split[1]}", "split",
                                   (("train.per_device_train_batch_size", str(split[0])),
                                    ("train.gradient_accumulation_steps", str(split[1]))),
                                   SAME, f"micro-batch {split[0]} x accumulation {split[1]}: {split[2]}"))
    if "checkpointing" in knobs:
        on = not t.gradient_checkpointing
        out.append(Variant("checkpointing" if on else "no-checkpointing", "checkpointing",
                           (("train.gradient_checkpointing", _yaml(on)),), SAME,
                           "activation checkpointing " + ("on" if on else "off")))
    if "precision" in knobs:
        if t.bf16 or t.fp16:
            flag = "train.bf16" if t.bf16 else "train.fp16"
            out.append(Variant("fp32", "precision", ((flag, "false"),), PRECISION, "fp32 (mixed precision off)"))
        elif cuda and not bf16_supported:
            out.append(Variant("fp16", "precision", (("train.fp16", "true"),), PRECISION,
                               "fp16 mixed precision with a gradient scaler (this GPU has no bf16)"))
        else:
            out.append(Variant("bf16", "precision", (("train.bf16", "true"),), PRECISION,
                               "bf16 mixed precision (autocast)"))
    if "tf32" in knobs:
        if not cuda:
            skipped.append("tf32: a no-op on CPU (TF32 is a CUDA matmul mode)")
        elif t.bf16 or t.fp16:
            skipped.append("tf32: the matmuls already run in mixed precision")
        else:
            out.append(Variant("tf32" if not t.tf32 else "no-tf32", "tf32", (("train.tf32", _yaml(not t.tf32)),),
                               PRECISION, "TF32 matmuls " + ("on" if not t.tf32 else "off")))
    if "optimizer" in knobs:
        if t.optim == "adamw_torch":
            out.append(Variant("adamw_torch_fused", "optimizer", (("train.optim", "adamw_torch_fused"),), SAME,
                               "the fused AdamW kernel (the same update)"))
        elif t.optim == "adamw_torch_fused":
            out.append(Variant("adamw_torch", "optimizer", (("train.optim", "adamw_torch"),), SAME,
                               "the for-each AdamW kernel (the same update)"))
        other = "adafactor" if t.optim != "adafactor" else "adamw_torch"
        out.append(Variant(other, "optimizer", (("train.optim", other),), DIFFERENT,
                           "Adafactor (factored second moments, less optimizer memory)" if other == "adafactor"
                           else "AdamW"))
        if cuda and bnb_available and t.optim != "adamw_bnb_8bit":
            out.append(Variant("adamw_bnb_8bit", "optimizer", (("train.optim", "adamw_bnb_8bit"),), DIFFERENT,
                               "8-bit AdamW states (bitsandbytes)"))
    if "attention" in knobs:
        other = "eager" if m.attn_implementation in (None, "sdpa", "flash_attention_2") else "sdpa"
        out.append(Variant(f"attn-{other}", "attention", (("model.attn_implementation", other),), SAME,
                           f"the {other} attention kernel" + (" (the model's own default: null)"
                                                              if m.attn_implementation is None else "")))
    if "compile" in knobs:
        on = not t.torch_compile
        out.append(Variant("compile" if on else "no-compile", "compile", (("train.torch_compile", _yaml(on)),),
                           SAME, "torch.compile (inductor) " + ("on" if on else "off")))
    if "allocator" in knobs:
        if cuda:
            skipped.append("allocator: train.cpu_allocator only matters when training on a CPU")
        else:
            other = "system" if t.cpu_allocator == "caching" else "caching"
            out.append(Variant(f"cpu-allocator-{other}", "allocator", (("train.cpu_allocator", other),), SAME,
                               "glibc's own malloc settings (freed memory goes back to the kernel)"
                               if other == "system" else "the caching host allocator (freed memory is reused)"))
    if "lora" in knobs:
        if m.lora_adapters is None:  # the dotted form when params.yaml has the mapping (r: 0), else the whole one
            out.append(Variant("lora", "lora", LORA_ROW if m.lora is not None else (("model.lora", LORA_MAPPING),),
                               DIFFERENT, "LoRA adapters r=8 (alpha, dropout, targets from your params) "
                                          "instead of every weight"))
        else:
            out.append(Variant("full-finetuning", "lora", (("model.lora.r", "0"),), DIFFERENT,
                               "full fine-tuning instead of LoRA"))
    return out, skipped


# -- measurements of one run ---------------------------------------------------------------------------

def steady_samples_per_second(r: RunRecord) -> float | None:
    """Examples per second over optimizer steps 2..N (step 1 holds warm-up: compilation, allocator
    growth): sum of ``step_examples`` / sum of ``step_time_s`` over those steps; the whole run's
    ``train_samples_per_second`` when the run has a single step or no per-step series."""
    times = dict(r.series.get("step_time_s", []))
    examples = dict(r.series.get("step_examples", []))
    steps = [s for s in sorted(times) if s >= 2 and s in examples]
    if steps:
        total = sum(times[s] for s in steps)
        if total > 0:
            return sum(examples[s] for s in steps) / total
    return r.metrics.get("train_samples_per_second")


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
    train_runtime_s: float | None = None
    eval_loss: float | None = None
    time_to_eval_loss_s: float | None = None
    verdict: str = "not run"
    # fit for the recommendation: same key and within fp32 (or tf32) tolerance, or apart only by dropout masks
    same_training: bool = False
    comparison: RunComparison | None = None
    notes: list[str] = field(default_factory=list)


def _reached(loss: float | None, target: float | None, rtol: float, atol: float) -> bool:
    return loss is not None and target is not None and loss <= target + atol + rtol * abs(target)


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
    if c.status == DIVERGED and any(x.startswith("dropout") for x in c.causes):
        return IN_EXPECTATION, True
    if c.status == DIVERGED:
        return f"diverged{where}" + (f": {c.causes[0]}" if c.causes else ""), False
    if c.status == INCOMPLETE:
        return c.verdict, False
    return c.verdict, False


def measure_row(v: Variant, run: RunRecord | None, baseline: RunRecord | None) -> Row:
    """Measure ``run`` (the variant's training run, None when it has not run) against ``baseline``."""
    row = Row(variant=v, run=run)
    if run is None:
        return row
    row.samples_per_second = steady_samples_per_second(run)
    row.memory_bytes, row.memory_kind = memory_bytes(run)
    times = dict(run.series.get("step_time_s", []))
    row.first_step_s = times.get(1)
    later = sorted(v for s, v in times.items() if s >= 2)
    if later:
        typical = later[len(later) // 2]
        slow = [(s, v) for s, v in sorted(times.items()) if s >= 2 and v > SLOW_STEP * typical]
        if slow:  # torch.compile recompiling for a new shape (an epoch's short last step), a stall
            row.notes.append("optimizer step " + ", ".join(f"{s} took {v:.1f} s" for s, v in slow)
                             + f" against a median {typical:.2f} s (torch.compile recompiles for each new batch "
                               "shape; otherwise a one-off stall); its samples/s count them")
    row.train_runtime_s = run.metrics.get("train_runtime")
    row.eval_loss = run.metrics.get("eval_loss")
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
    # Time to the baseline's eval loss: the training time when the run's final eval loss is at least as
    # good (within its precision's tolerance); eval loss is measured once, after training.
    tol = c.tolerance
    if _reached(row.eval_loss, baseline.metrics.get("eval_loss"), tol.rtol, tol.atol):
        row.time_to_eval_loss_s = row.train_runtime_s
    return row


def measure_rows(variants: list[Variant], runs: dict[str, RunRecord]) -> list[Row]:
    """One :class:`Row` per variant; ``runs`` maps a variant name to its training run (absent: not run)."""
    baseline = runs.get("baseline")
    return [measure_row(v, runs.get(v.name), baseline) for v in variants]


# -- the recommendation ----------------------------------------------------------------------------

@dataclass
class Recommendation:
    """The fastest same-training configuration that fits the budget.

    Attributes:
        variant: the combined variant (its overrides), or None when the user's params are already the
            fastest measured same-training configuration.
        parts: the rows whose knobs it combines.
        left_out: ``(row name, reason)`` for the same-training rows not taken.
        budget_bytes: the memory budget it was checked against (None: no budget).
    """
    variant: Variant | None
    parts: list[Row]
    left_out: list[tuple[str, str]]
    budget_bytes: float | None


def recommend(rows: list[Row], budget_bytes: float | None, min_gain: float | None = None) -> Recommendation:
    """Combine the knobs whose runs kept the same training (fp32 tolerance; TF32 within its own; other
    dropout masks only: :data:`IN_EXPECTATION`),
    fit ``budget_bytes`` (compared with :attr:`Row.memory_bytes`; None = no budget) and were at least
    ``min_gain`` faster than the baseline in steady-state samples/s. One knob's variant stands for
    itself; several are merged into a ``recommended`` variant (their overrides together), which must be
    measured once more: knobs do not multiply exactly. ``min_gain`` None: :data:`MIN_GAIN`."""
    min_gain = MIN_GAIN if min_gain is None else min_gain
    parts, left_out = [], []
    for r in rows:
        if r.variant.knob in ("baseline", "recommended") or r.variant.expect == DIFFERENT:
            continue  # a different training is never a candidate
        if r.run is None:
            left_out.append((r.variant.name, "not run"))
        elif not r.same_training:
            left_out.append((r.variant.name, r.verdict))
        elif budget_bytes is not None and (r.memory_bytes is None or r.memory_bytes > budget_bytes):
            left_out.append((r.variant.name, "over the memory budget"))
        elif r.speedup is None or r.speedup < 1 + min_gain:
            left_out.append((r.variant.name, "not faster" if r.speedup is None or r.speedup < 1
                             else f"{(r.speedup - 1) * 100:.0f}% faster: within run-to-run noise"))
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
