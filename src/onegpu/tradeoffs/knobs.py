"""The plan of ``onegpu tradeoffs``: the baseline (the user's params) and one DVC experiment per knob of
the single-GPU guide, each as the ``-S`` overrides of a ``dvc exp run``.

One small function per knob (:data:`KNOBS`, in the guide's order): ``(cfg, facts) -> [Variant, ...]``, or
a string saying why the knob does not apply to these params on this machine. To add a knob: write such
a function, add it to :data:`KNOBS` under the name ``--knobs`` takes, add what the guide says of it to
:data:`onegpu.tradeoffs.report.GUIDE`, and add a case to ``tests/unit/tradeoffs/test_knobs.py`` (its
variant validates and its equivalence key is the one ``expect`` promises).

The guide: "Methods and tools for efficient training on a single GPU", Hugging Face transformers docs
(perf_train_gpu_one). This module imports only the standard library and :mod:`onegpu.errors`
(``onegpu --help`` lists the knobs).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from onegpu.errors import UserError

if TYPE_CHECKING:
    from onegpu.config import Config, DeviceFacts

# What the equivalence key says of a variant before it runs.
SAME = "same"            # same key: the same mathematics (split, recompute, kernel)
PRECISION = "precision"  # the same mathematics in lower precision: compared within its tolerance
DIFFERENT = "different"  # another training (optimizer, LoRA): another key

# LoRA settings of the LoRA row when the user's params train the whole model (peft's usual starting point).
LORA_ROW = (("model.lora.r", "8"),)
LORA_MAPPING = "{r: 8, alpha: 16, dropout: 0.0, target_modules: null}"


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
    def assignments(self) -> list[str]:
        """``["key=value", ...]``, as :func:`onegpu.config.load` and ``dvc exp run -S`` take them."""
        return [f"{k}={v}" for k, v in self.overrides]

    @property
    def set_args(self) -> list[str]:
        """``["-S", "key=value", ...]`` for ``dvc exp run``."""
        return [a for kv in self.assignments for a in ("-S", kv)]

    @property
    def set_text(self) -> str:
        """The overrides as one could paste them after ``dvc exp run``: ``-S 'key=value' ...``."""
        return " ".join(f"-S '{k}={v}'" for k, v in self.overrides)


def _yaml(v: bool) -> str:
    return "true" if v else "false"


def _toggle(name: str, knob: str, key: str, on: bool, expect: str, what: str) -> Variant:
    """The variant that sets boolean ``key`` to ``on``, named ``name`` (on) or ``no-<name>`` (off)."""
    return Variant(name if on else f"no-{name}", knob, ((key, _yaml(on)),), expect, f"{what} {'on' if on else 'off'}")


def split(cfg: Config, facts: DeviceFacts) -> list[Variant] | str:
    """Another split of the same effective batch: twice the micro-batch (half the accumulation), else half."""
    micro, accum = cfg.train.per_device_train_batch_size, cfg.train.gradient_accumulation_steps
    if micro == "auto":
        return "the micro-batch is `auto` (the finder picks the largest that fits)"
    if accum % 2 == 0:
        m, a, how = int(micro) * 2, accum // 2, "a larger micro-batch, fewer accumulated micro-batches"
    elif int(micro) % 2 == 0:
        m, a, how = int(micro) // 2, accum * 2, "a smaller micro-batch, more accumulated micro-batches"
    else:
        return f"{micro} x {accum} has no other split by 2"
    return [Variant(f"split-{m}x{a}", "split", (("train.per_device_train_batch_size", str(m)),
                                               ("train.gradient_accumulation_steps", str(a))),
                    SAME, f"micro-batch {m} x accumulation {a}: {how}")]


def checkpointing(cfg: Config, facts: DeviceFacts) -> list[Variant] | str:
    """Activation checkpointing the other way."""
    return [_toggle("checkpointing", "checkpointing", "train.gradient_checkpointing",
                    not cfg.train.gradient_checkpointing, SAME, "activation checkpointing")]


def precision(cfg: Config, facts: DeviceFacts) -> list[Variant] | str:
    """fp32 when the params use mixed precision; else bf16, or fp16 on a GPU without bf16."""
    t = cfg.train
    if t.bf16 or t.fp16:
        return [Variant("fp32", "precision", (("train.bf16" if t.bf16 else "train.fp16", "false"),), PRECISION,
                        "fp32 (mixed precision off)")]
    if facts.cuda and not facts.bf16:
        return [Variant("fp16", "precision", (("train.fp16", "true"),), PRECISION,
                        "fp16 mixed precision with a gradient scaler (this GPU has no bf16)")]
    return [Variant("bf16", "precision", (("train.bf16", "true"),), PRECISION, "bf16 mixed precision (autocast)")]


def tf32(cfg: Config, facts: DeviceFacts) -> list[Variant] | str:
    """TF32 matmuls the other way (CUDA, fp32 matmuls only)."""
    if not facts.cuda:
        return "a no-op on CPU (TF32 is a CUDA matmul mode)"
    if cfg.train.bf16 or cfg.train.fp16:
        return "the matmuls already run in mixed precision"
    return [_toggle("tf32", "tf32", "train.tf32", not cfg.train.tf32, PRECISION, "TF32 matmuls")]


def optimizer(cfg: Config, facts: DeviceFacts) -> list[Variant] | str:
    """The other AdamW kernel (the same update), Adafactor (or AdamW), 8-bit AdamW (bitsandbytes' on CUDA with
    bitsandbytes, else torchao's where it is installed, CPU too) and torchao's 4-bit AdamW."""
    optim, out = cfg.train.optim, []
    if optim in ("adamw_torch", "adamw_torch_fused"):
        other = "adamw_torch" if optim == "adamw_torch_fused" else "adamw_torch_fused"
        out.append(Variant(other, "optimizer", (("train.optim", other),), SAME,
                           f"the {'for-each' if other == 'adamw_torch' else 'fused'} AdamW kernel (the same update)"))
    other = "adafactor" if optim != "adafactor" else "adamw_torch"
    out.append(Variant(other, "optimizer", (("train.optim", other),), DIFFERENT,
                       "Adafactor (factored second moments, less optimizer memory)" if other == "adafactor"
                       else "AdamW"))
    bnb = facts.cuda and "bitsandbytes" in facts.packages
    if bnb and optim != "adamw_bnb_8bit":
        out.append(Variant("adamw_bnb_8bit", "optimizer", (("train.optim", "adamw_bnb_8bit"),), DIFFERENT,
                           "8-bit AdamW states (bitsandbytes)"))
    for bits in ((4,) if bnb else (8, 4)) if "torchao" in facts.packages else ():
        name = f"adamw_torch_{bits}bit"
        if optim != name:
            out.append(Variant(name, "optimizer", (("train.optim", name),), DIFFERENT,
                               f"{bits}-bit AdamW states (torchao)"))
    return out


def attention(cfg: Config, facts: DeviceFacts) -> list[Variant] | str:
    """eager attention, or SDPA when the params ask for eager."""
    attn = cfg.model.attn_implementation
    other = "eager" if attn in (None, "sdpa", "flash_attention_2") else "sdpa"
    return [Variant(f"attn-{other}", "attention", (("model.attn_implementation", other),), SAME,
                    f"the {other} attention kernel" + (" (the model's own default: null)" if attn is None else ""))]


def torch_compile(cfg: Config, facts: DeviceFacts) -> list[Variant] | str:
    """torch.compile the other way."""
    return [_toggle("compile", "compile", "train.torch_compile", not cfg.train.torch_compile, SAME,
                    "torch.compile (inductor)")]


def allocator(cfg: Config, facts: DeviceFacts) -> list[Variant] | str:
    """The other host allocator setting (a CPU training only)."""
    if facts.cuda:
        return "train.cpu_allocator only matters when training on a CPU"
    other = "system" if cfg.train.cpu_allocator == "caching" else "caching"
    return [Variant(f"cpu-allocator-{other}", "allocator", (("train.cpu_allocator", other),), SAME,
                    "glibc's own malloc settings (freed memory goes back to the kernel)" if other == "system"
                    else "the caching host allocator (freed memory is reused)")]


def lora(cfg: Config, facts: DeviceFacts) -> list[Variant] | str:
    """LoRA adapters instead of full fine-tuning, or the other way: the dotted ``-S model.lora.r`` when
    params.yaml has the mapping (``r: 0`` = off), else the whole mapping (DVC cannot set a dotted key in null)."""
    if cfg.model.lora_adapters is None:
        return [Variant("lora", "lora", LORA_ROW if cfg.model.lora is not None else (("model.lora", LORA_MAPPING),),
                        DIFFERENT, "LoRA adapters r=8 (alpha, dropout, targets from your params) "
                                   "instead of every weight")]
    return [Variant("full-finetuning", "lora", (("model.lora.r", "0"),), DIFFERENT,
                    "full fine-tuning instead of LoRA")]


def _causal_lm_only(cfg: Config, pairs_too: bool = False) -> str | None:
    from onegpu.config import causal_lm, token_level
    if not (causal_lm if pairs_too else token_level)(cfg.model.task):
        return (f"causal LM (instruction fine-tuning) only: model.task is {cfg.model.task}, whose rows are "
                "one label each, nothing to flatten or pack")
    return None


def padding_free(cfg: Config, facts: DeviceFacts) -> list[Variant] | str:
    """Padding-free batches the other way (causal LM only): the same examples in the same steps, each
    micro-batch flattened into one row (no compute on padding); outside the equivalence key."""
    if (why := _causal_lm_only(cfg, pairs_too=True)) is not None:
        return why
    if cfg.data.packing:
        return "data.packing is on: packed rows are collated padding-free already"
    return [_toggle("padding-free", "padding_free", "data.padding_free", not cfg.data.padding_free, SAME,
                    "padding-free batches (one flattened row per micro-batch, position_ids)")]


def packing(cfg: Config, facts: DeviceFacts) -> list[Variant] | str:
    """Packing the other way (causal LM only): examples packed into rows of ``data.max_length``, so other
    examples share each micro-batch and step and a step counts packed rows: another equivalence key."""
    if (why := _causal_lm_only(cfg)) is not None:
        return why
    return [_toggle("packing", "packing", "data.packing", not cfg.data.packing, DIFFERENT,
                    "packing (examples packed into rows of data.max_length; a step counts rows)")]


def fused_lm_head(cfg: Config, facts: DeviceFacts) -> list[Variant] | str:
    """The fused LM head the other way (causal LM only): the targets' logits in tiles, or the whole
    ``(micro_batch, seq_len, vocab)`` logits; the same loss over the same targets, outside the equivalence key."""
    from onegpu.config import causal_lm
    if not causal_lm(cfg.model.task):
        return f"causal LM only: model.task is {cfg.model.task}, whose output layer is one row per example"
    return [_toggle("fused-lm-head", "fused_lm_head", "train.fused_lm_head", not cfg.train.fused_lm_head, SAME,
                    "the fused LM head (logits only at target positions, in tiles)")]


def activation_offloading(cfg: Config, facts: DeviceFacts) -> list[Variant] | str:
    """Activation offloading the other way (CUDA only): the saved activations in host memory; the same values."""
    if not facts.cuda:
        return "CUDA only (on a CPU the activations are in host memory already)"
    return [_toggle("offloading", "activation_offloading", "train.activation_offloading",
                    not cfg.train.activation_offloading, SAME, "activation offloading to host memory")]


def reference(cfg: Config, facts: DeviceFacts) -> list[Variant] | str:
    """DPO's reference the other way (preference tuning only): its log-probabilities scored once before training
    (``train.dpo.precompute_ref_log_probs``: no frozen copy in memory, no reference forward per micro-batch), or
    a live reference beside each micro-batch (a frozen copy, or LoRA's base: the lora row); the same reference,
    outside the equivalence key."""
    from onegpu.config import has_reference
    if not has_reference(cfg.model.task):
        return f"preference tuning (DPO) only: model.task {cfg.model.task} has no reference model"
    return [_toggle("precomputed-reference", "reference", "train.dpo.precompute_ref_log_probs",
                    not cfg.train.dpo.precompute_ref_log_probs, SAME,
                    "the reference's log-probabilities scored once (no reference model kept or run per step)")]


def sharding(cfg: Config, facts: DeviceFacts) -> list[Variant] | str:
    """FSDP2 sharding (``train.fsdp.enabled``) the other way, over the ``train.num_processes`` processes (2 or more):
    each rank keeps 1/N of the weights, gradients and optimizer states instead of a whole copy, for an all-gather
    per block in forward and backward and a reduce-scatter of the gradients per step; the same training, outside
    the equivalence key. Turning it on under the trainer backend adds ``train.backend=accelerate`` (FSDP2 runs in
    the accelerate backend only; the backend is outside the key too) and, under ``train.oom_retry``,
    ``train.oom_retry=false`` (refused under sharding; it acts only on an out-of-memory error, so the row
    measures the same otherwise). A row that :func:`onegpu.config.validate` would refuse (FSDP2 with
    ``torch_compile``, fp16, several machines) is not planned, so none fails at its start: the refusal's text is
    the reason."""
    from onegpu import config
    if cfg.train.num_processes < 2:
        return (f"FSDP2 shards over processes and train.num_processes is {cfg.train.num_processes}; set "
                "train.num_processes to 2 or more (on a CPU gloo processes count)")
    on = not cfg.train.fsdp.enabled
    backend = (("train.backend", "accelerate"),) if on and cfg.train.backend == "trainer" else ()
    # train.oom_retry (refused under sharding) acts only on an out-of-memory error: off, the row measures the same
    retry = (("train.oom_retry", "false"),) if on and cfg.train.oom_retry else ()
    overrides = (*backend, *retry, ("train.fsdp.enabled", _yaml(on)))
    raw = cfg.to_dict()
    for key, value in overrides:
        config.apply_override(raw, f"{key}={value}")
    try:
        config.from_container(raw, source="the row's params")
    except UserError as e:
        return f"{e} (`onegpu tradeoffs -S key=value` sets a key for every row)"
    n = cfg.train.num_processes
    return [Variant("sharding" if on else "no-sharding", "sharding", overrides, SAME,
                    f"FSDP2 sharding over {n} processes (1/{n} of the weights, gradients and optimizer states each"
                    + (", the accelerate backend" if backend else "") + (", no oom_retry" if retry else "") + ")"
                    if on
                    else f"data parallel over {n} processes (a whole copy each) instead of FSDP2 sharding")]


# The knob names (`--knobs` takes these), in the guide's order, and the function of each.
KNOBS: dict[str, Callable[[Config, DeviceFacts], list[Variant] | str]] = {
    "split": split, "checkpointing": checkpointing, "precision": precision, "tf32": tf32,
    "optimizer": optimizer, "attention": attention, "compile": torch_compile, "allocator": allocator, "lora": lora,
    "padding_free": padding_free, "packing": packing, "fused_lm_head": fused_lm_head,
    "activation_offloading": activation_offloading, "reference": reference, "sharding": sharding,
}


# The overrides whose row compiles its step (inductor: C++ kernels on a CPU, tens of seconds in an environment
# whose compiler cache is cold): on a CPU such rows run only when ``--knobs`` names their knob.
COMPILING = frozenset({("train.torch_compile", "true"), ("train.optim", "adamw_torch_8bit"),
                       ("train.optim", "adamw_torch_4bit")})


def compiles(v: Variant) -> bool:
    """Whether row ``v``'s optimizer step compiles (torch.compile, torchao's low-bit AdamW): :data:`COMPILING`."""
    return any(o in COMPILING for o in v.overrides)


def plan(cfg: Config, facts: DeviceFacts, knobs: tuple[str, ...] | None = None) -> tuple[list[Variant], list[str]]:
    """The baseline and the variants of each of ``knobs`` that applies.

    Args:
        cfg: the user's params (the baseline).
        facts: the machine (:func:`onegpu.measure.memory.device_facts`): TF32, fp16 and the 8-bit optimizer
            apply only with CUDA, bf16 needs a GPU that has it, 8-bit AdamW needs bitsandbytes.
        knobs: the subset to plan (names of :data:`KNOBS`); None: every knob, less, on a CPU, the rows whose
            step compiles (:func:`compiles`: their first step compiles C++ kernels for longer than the other
            rows train; ``--knobs compile,optimizer`` measures them).
    Returns:
        ``(variants, skipped)``: the baseline first, then the variants in the guide's order; ``skipped``
        says for each left-out knob or row why (``"<knob>: <why>"``).
    """
    out, skipped = [Variant("baseline", "baseline", (), SAME, "your params.yaml")], []
    for name, knob in KNOBS.items():
        if knobs is None or name in knobs:
            got = knob(cfg, facts)
            if isinstance(got, str):
                skipped.append(f"{name}: {got}")
                continue
            later = [v.name for v in got if knobs is None and not facts.cuda and compiles(v)]
            if later:
                skipped.append(f"{name}: {', '.join(later)} left out on a CPU unless --knobs names {name} (the "
                               "step compiles C++ kernels first: tens of seconds the first time in an environment)")
            out.extend(v for v in got if v.name not in later)
    return out, skipped


def with_overrides(variants: list[Variant], common: list[tuple[str, str]]) -> list[Variant]:
    """Every variant with ``common`` (``tradeoffs -S key=value``) before its own overrides (its own win
    on the same key: ``dvc exp run -S`` applies them in order)."""
    if not common:
        return variants
    return [Variant(v.name, v.knob, (*tuple(common), *v.overrides), v.expect, v.what) for v in variants]


def parse_knobs(text: str | None) -> tuple[str, ...] | None:
    """``--knobs split,precision,...`` as a tuple of :data:`KNOBS` names (None: None, the default set of
    :func:`plan`).

    Raises:
        UserError: an unknown name or an empty list.
    """
    if text is None:
        return None
    knobs = tuple(k.strip() for k in text.split(",") if k.strip())
    bad = [k for k in knobs if k not in KNOBS]
    if bad or not knobs:
        raise UserError(f"--knobs {text!r}: {'unknown ' + ', '.join(bad) if bad else 'empty'}; choose from "
                        f"{','.join(KNOBS)}")
    return knobs
