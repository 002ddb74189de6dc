"""Why two runs of one equivalence key can differ step by step: the likely causes found in their params
and tags, one small function per cause (:data:`CAUSES`).

A cause function takes ``(run, reference)`` (:class:`~onegpu.compare.records.RunRecord`) and returns the
sentences it finds (none when it does not apply); :func:`likely_causes` lists them in :data:`CAUSES`'
order. A cause is named only where the run differs from the reference in it; a divergent run that differs
in none gets :func:`numerical_note` instead. To add a cause: write one such function, add it to
:data:`CAUSES`, and add a pair of records that shows it to ``tests/unit/compare/test_causes.py``. No MLflow
here.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

from onegpu.compare.records import RunRecord, as_float, as_int
from onegpu.config import LOW_BIT_OPTIMIZERS

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

# Instruction-data knobs (issue 21; TRL's names): (param, value when not logged, what a difference means).
# Only data.padding_free is outside the equivalence key; the others are in it when on, so runs that differ
# in them never share a group (``onegpu tradeoffs`` compares them with its baseline all the same).
SFT_KNOBS = (
    ("data.padding_free", "false",
     "the same training (outside the equivalence key, compared within the fp32 tolerance): the same examples "
     "in the same micro-batches and steps, flattened into one row per micro-batch with position_ids, so a "
     "divergence beyond the tolerance means attention crossed a sequence boundary or a kernel summed in "
     "another order"),
    ("data.packing", "false",
     "its own equivalence key: packing fills rows of data.max_length with several examples, so other "
     "examples share each micro-batch and step and the effective batch counts packed rows, not examples; "
     "compare packed runs with packed runs"),
    ("data.completion_only_loss", "none",
     "a different training: the loss is over other tokens (the completion only, or prompt and completion; "
     "null: on for prompt-completion data)"),
    ("data.assistant_only_loss", "false",
     "a different training: the loss is over other tokens (the assistant turns only, or every token)"),
)

# Knobs whose kernels draw dropout masks differently (SDPA's fused dropout, inductor's generated RNG code).
DROPOUT_KERNEL_KNOBS = ("model.attn_implementation", "train.torch_compile")

# The phrase every dropout cause starts with (``onegpu tradeoffs`` reads it: other masks only).
DROPOUT = "dropout"


def _dropout(r: RunRecord) -> float:
    # The model's largest dropout probability (tag set by the train stage); else the params override.
    v = as_float(r.tags.get("model.dropout_max"))
    return v if v is not None else (as_float(r.params.get("model.dropout")) or 0.0)


def _param(r: RunRecord, key: str, default: str) -> str:
    """A logged param in lower case (``None``/``null`` as ``none``), ``default`` when the run lacks it."""
    v = str(r.params.get(key, default)).strip().lower()
    return "none" if v in ("none", "null", "") else v


def _micro_batches(run: RunRecord, reference: RunRecord) -> str:
    return f"{run.micro_batch} vs {reference.micro_batch}"


def dropout_with_another_split(run: RunRecord, reference: RunRecord) -> Iterable[str]:
    """Dropout on and another micro-batch: each split draws other masks."""
    p = max(_dropout(run), _dropout(reference))
    if p > 0 and run.micro_batch != reference.micro_batch:
        yield (f"{DROPOUT} (p up to {p:g}) with a different micro-batch ({_micro_batches(run, reference)}): each "
               "split draws different dropout masks, so the runs agree only in expectation "
               "(set model.dropout: 0 to compare exactly)")


def dropout_with_another_kernel(run: RunRecord, reference: RunRecord) -> Iterable[str]:
    """Dropout on and another attention or compiled kernel (:data:`DROPOUT_KERNEL_KNOBS`): other masks."""
    p = max(_dropout(run), _dropout(reference))
    kernels = [k for k in DROPOUT_KERNEL_KNOBS if _param(run, k, "none") != _param(reference, k, "none")]
    if p > 0 and kernels:
        yield (f"{DROPOUT} (p up to {p:g}) with another kernel ({', '.join(kernels)} differs): it draws its "
               "dropout masks from the random generator in another way, so the runs agree only in "
               "expectation (set model.dropout: 0 to compare exactly)")


def batchnorm_with_another_split(run: RunRecord, reference: RunRecord) -> Iterable[str]:
    """BatchNorm layers and another micro-batch: statistics per micro-batch."""
    bn = max(as_int(run.tags.get("model.batchnorm_layers")) or 0,
             as_int(reference.tags.get("model.batchnorm_layers")) or 0)
    if bn > 0 and run.micro_batch != reference.micro_batch:
        yield (f"{bn} BatchNorm layer(s) with a different micro-batch ({_micro_batches(run, reference)}): mean "
               "and variance are computed per micro-batch, so the forward pass itself differs")


def mixed_precision(run: RunRecord, reference: RunRecord) -> Iterable[str]:
    """Another precision on one side, bf16 or fp16 on at least one: rounded activations."""
    mixed = sorted({r.precision for r in (run, reference) if r.precision not in ("fp32", "tf32")})
    if mixed and run.precision != reference.precision:
        yield (f"mixed precision ({', '.join(mixed)}): activations are rounded to "
               f"{'/'.join(mixed)}, and a different summation order rounds differently")


# Same-training knobs not named elsewhere here: (param, value when not logged, words for a boolean knob that
# is on). Proven the same training in float64 (docs/details.md, "The equivalence key"), so a divergence
# between runs that differ in one means its loss path rounds differently on this job: the likely cause.
SAME_TRAINING_KNOBS = (("train.fused_lm_head", "false", "the fused LM head"),
                       ("train.gradient_checkpointing", "false", "activation checkpointing"),
                       ("train.gradient_checkpointing_blocks", "layer", None),
                       ("train.activation_offloading", "false", "activation offloading"),
                       ("train.fsdp.enabled", "false", "FSDP2 sharding"),
                       ("train.num_processes", "1", None))
# Boolean knobs of the loss path that :func:`numerical_note` names when on in both runs: those above and
# the ones KERNEL_KNOBS and SFT_KNOBS name when they differ.
LOSS_PATH_KNOBS = tuple((k, what) for k, _, what in SAME_TRAINING_KNOBS if what) + (
    ("data.padding_free", "padding-free batches"), ("train.torch_compile", "torch.compile"), ("train.tf32", "TF32"))


def same_training_knobs(run: RunRecord, reference: RunRecord) -> Iterable[str]:
    """Each knob of :data:`SAME_TRAINING_KNOBS` whose value differs."""
    for knob, default, _ in SAME_TRAINING_KNOBS:
        a, b = _param(run, knob, default), _param(reference, knob, default)
        if a != b and (knob != "train.fused_lm_head" or _causal_lm(reference)):
            yield (f"{knob} differs ({a} vs {b}): the same training by design (proven in float64), so its loss "
                   "path rounds differently on this job")


def _causal_lm(r: RunRecord) -> bool:
    """Whether ``r``'s model is a causal LM (its ``model.task``; a run logged without it: not known, so yes):
    a classifier has no LM head for ``train.fused_lm_head`` to act on."""
    from onegpu.config import causal_lm
    task = r.params.get("model.task")
    return task is None or causal_lm(task)


def numerical_note(run: RunRecord, reference: RunRecord) -> str:
    """What to say of a divergent pair that :func:`likely_causes` finds no cause for: no setting differs, so
    the difference is numerical, in the loss path; with the same-training knobs on in both runs, their
    precision (bf16, fp16) and a GPU on both (non-deterministic reductions), which that path runs through."""
    on = [what for knob, what in LOSS_PATH_KNOBS if _param(run, knob, "false") == _param(reference, knob, "false")
          not in ("false", "none", "0") and (knob != "train.fused_lm_head" or _causal_lm(reference))]
    attn = _param(reference, "model.attn_implementation", "none")
    if attn != "none":
        on.append(f"{attn} attention")
    if run.precision not in ("fp32", "tf32"):
        on.append(run.precision)
    device = run.tags.get("device", "")
    if device and device.lower() != "cpu":
        on.append(f"non-deterministic GPU kernels ({device})")
    return ("no setting differs from the reference: a numerical difference in the loss path"
            + (f" (on in both runs: {', '.join(on)})" if on else ""))


def kernel_knobs(run: RunRecord, reference: RunRecord) -> Iterable[str]:
    """Each knob of :data:`KERNEL_KNOBS` whose value differs."""
    for knob, default, why in KERNEL_KNOBS:
        a, b = _param(run, knob, default), _param(reference, knob, default)
        if knob == "train.optim" and {a, b} & LOW_BIT_OPTIMIZERS.keys():
            continue  # not a kernel: quantised_optimizer_states says why
        if a != b:
            yield f"{knob} differs ({a} vs {b}): {why}"


def quantised_optimizer_states(run: RunRecord, reference: RunRecord) -> Iterable[str]:
    """A low-bit AdamW (:data:`onegpu.config.LOW_BIT_OPTIMIZERS`: bitsandbytes' or torchao's 8-bit, torchao's
    4-bit) on one side only, or with other bits: its moments are quantised, so its steps differ by design."""
    a, b = _param(run, "train.optim", "adamw_torch"), _param(reference, "train.optim", "adamw_torch")
    low = [(name, LOW_BIT_OPTIMIZERS[name]) for name in (a, b) if name in LOW_BIT_OPTIMIZERS]
    if a != b and low:
        states = "; ".join(f"{name} keeps AdamW's two moments quantised to {bits} bits (block-wise, one fp32 "
                           "scale per block)" for name, bits in low)
        yield (f"train.optim differs ({a} vs {b}): {states}, so its steps differ from fp32 AdamW's by design "
               "(another training with its own equivalence key, not a rounding difference)")


def instruction_data(run: RunRecord, reference: RunRecord) -> Iterable[str]:
    """Each knob of :data:`SFT_KNOBS` whose value differs, with what the difference means."""
    for knob, default, meaning in SFT_KNOBS:
        a, b = _param(run, knob, default), _param(reference, knob, default)
        if a != b:
            yield f"{knob} differs ({a} vs {b}): {meaning}"


def another_backend(run: RunRecord, reference: RunRecord) -> Iterable[str]:
    rb, fb = run.params.get("train.backend"), reference.params.get("train.backend")
    if rb and fb and rb != fb:
        yield f"a different backend ({rb} vs {fb}): the training loops order the work differently"


def another_device(run: RunRecord, reference: RunRecord) -> Iterable[str]:
    rd, fd = run.tags.get("device"), reference.tags.get("device")
    if rd and fd and rd != fd:
        yield f"a different device ({rd} vs {fd})"


def other_code(run: RunRecord, reference: RunRecord) -> Iterable[str]:
    rc, fc = run.tags.get("mlflow.source.git.commit"), reference.tags.get("mlflow.source.git.commit")
    if rc and fc and rc != fc and "none" not in (rc, fc):
        yield f"different code (commit {rc[:8]} vs {fc[:8]})"


def another_training(run: RunRecord, reference: RunRecord, named: list[str]) -> Iterable[str]:
    """A run of another equivalence key (compared only when runs are named together, ``--exp`` / ``--runs``):
    the params in the key that differ (at most 4) and that no sentence of ``named`` (the other causes)
    names already; when none of the logged ones differs and no other cause is given, its data or code."""
    if run.key is None or reference.key is None or run.key == reference.key:
        return
    from onegpu.equivalence.key import NOT_IN_EQUIVALENCE_KEY
    differ = [f"{k} {run.params[k]} vs {reference.params[k]}"
              for k in sorted(set(run.params) & set(reference.params))
              if k.startswith(("data.", "model.", "train.")) and k not in NOT_IN_EQUIVALENCE_KEY
              and _param(run, k, "") != _param(reference, k, "") and not any(k in sentence for sentence in named)]
    if differ:
        yield (f"{', '.join(differ[:4])} differ{'s' if len(differ) == 1 else ''}: another training (another "
               "equivalence key, compared because the runs were named together)")
    elif not named:
        yield "another training (another equivalence key: its data or a setting not logged as a param differ)"


# Every cause, in the order the report lists them.
CAUSES: tuple[Callable[[RunRecord, RunRecord], Iterable[str]], ...] = (
    instruction_data, dropout_with_another_split, dropout_with_another_kernel, batchnorm_with_another_split,
    mixed_precision, kernel_knobs, same_training_knobs, quantised_optimizer_states, another_backend, another_device,
    other_code,
)


def likely_causes(run: RunRecord, reference: RunRecord) -> list[str]:
    """Params and tags of a pair that explain why their losses can differ step by step: the sentences of
    every function in :data:`CAUSES`, in that order, after :func:`another_training`'s. Each names a
    setting in which ``run`` differs from ``reference`` (a split alone is none: splits are the same
    training); [] when no such setting differs (:func:`numerical_note` says what that means)."""
    named = [sentence for cause in CAUSES for sentence in cause(run, reference)]
    return list(another_training(run, reference, named)) + named
