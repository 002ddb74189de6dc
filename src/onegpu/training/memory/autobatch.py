"""Choosing the micro-batch: the `auto` finder and the memory estimate.

The guide's advice: use the largest micro-batch that fits, make up the rest with accumulation (4 x 16,
not 1 x 64). HF Trainer's ``auto_find_batch_size`` and accelerate's ``find_executable_batch_size``
shrink the *effective* batch when memory runs out, which changes the training. This finder keeps the
effective batch N fixed and only picks the split: the largest divisor of N whose probe step fits
the memory budget.

Memory of one training step with micro-batch m (bytes):

    params + grads + optimizer states + activations(m)

where activations(m) are the bytes autograd saves for backward (:func:`onegpu.measure.memory.activation_bytes`);
under bf16/fp16 autocast the 2-byte weight copies it keeps for backward are added (a fixed amount,
:func:`onegpu.measure.memory.saved_bytes`).
On CUDA a probe runs a real forward and backward and reads the allocator peak (an out-of-memory
error counts as "does not fit"), plus the optimizer states that do not exist yet. On CPU, where
nothing runs out of memory by itself, the breakdown is used. Probes use the longest training rows,
restore the RNG and leave no gradients: the run that follows sees exactly what it would have seen.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

from onegpu.errors import ConfigError, UserError
from onegpu.formatting import GiB, gib, markdown_table, mib
from onegpu.measure import memory
from onegpu.measure.optimizer_states import optimizer_state_bytes

SAFETY = 0.9  # use at most 90% of the budget: allocator fragmentation, buffers, the next batch's copy


@dataclass
class Probe:
    """One tried micro-batch: its predicted or measured peak (bytes) against the usable budget."""
    micro_batch: int
    peak_bytes: int
    usable_bytes: int
    fits: bool
    how: str  # "measured (CUDA allocator)", "out of memory", "breakdown" or "breakdown, one rank's shards"

    def as_row(self) -> dict:
        return asdict(self)


def divisors_desc(n: int) -> list[int]:
    """Divisors of ``n``, largest first: the micro-batches that split ``n`` exactly."""
    return [d for d in range(n, 0, -1) if n % d == 0]


def longest_rows(dataset, n: int) -> list[int]:
    """Indices of the ``n`` longest rows (``length`` column; ties by index): the worst-case micro-batch."""
    lengths = dataset["length"] if "length" in dataset.column_names else [len(x) for x in dataset["input_ids"]]
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    return order[:n] if n <= len(order) else (order * (n // len(order) + 1))[:n]


def state_bytes_predicted(model, optim: str) -> dict[str, int]:
    """Params (as held), grads (one per trainable parameter, same dtype) and optimizer states (bytes)."""
    params = memory.tensors_bytes(model.parameters())
    grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return {"mem_params_bytes": params, "mem_grads_bytes": grads,
            "mem_optimizer_bytes": optimizer_state_bytes(model, optim)}


def _batch(dataset, collator, rows: list[int], device) -> dict:
    b = collator([dataset[i] for i in rows])
    return {k: v.to(device) for k, v in b.items()}


def find_micro_batch(model, dataset, collator, loss_fn, effective_batch_size: int, budget_bytes: int,
                     optim: str, device: str, world_size: int = 1,
                     mixed_precision: str = "no", extra_bytes: int = 0,
                     states_at: Callable[[int], dict[str, int]] | None = None) -> tuple[int, list[Probe]]:
    """The largest micro-batch dividing ``effective_batch_size / world_size`` whose step fits.

    Args:
        model: the model as it will train (on ``device``, checkpointing set as configured).
        dataset: training rows with ``input_ids`` (and ``length``); collator: the training collator.
        loss_fn: ``(outputs, labels) -> loss``.
        budget_bytes: memory the step may use; :data:`SAFETY` of it is used.
        mixed_precision: ``train.mixed_precision``; each probe's forward pass runs under :func:`autocast`
            for it, as the training's does (bf16/fp16 activations are half the fp32 bytes).
        extra_bytes: what the run keeps beside the model and is not on the device yet (a DPO reference copy,
            :meth:`onegpu.training.objectives.base.Objective.memory_terms`), added to every probe's peak.
        states_at: micro-batch -> the bytes held beside the activations (params, grads, optimizer states); None:
            the whole model's (:func:`state_bytes_predicted`). Under FSDP2 one rank's, whose gradients depend on
            the accumulation each micro-batch implies (:func:`onegpu.training.parallel.sharding.per_rank_bytes`); such
            a probe is the breakdown on CUDA too (a measured step would hold the whole model's gradients).
    Returns:
        (micro-batch, every probe tried, largest first).
    Raises:
        UserError: not even a micro-batch of 1 fits.
    """
    import torch
    per_process = effective_batch_size // world_size
    usable = int(budget_bytes * SAFETY)
    whole = state_bytes_predicted(model, optim)
    probes: list[Probe] = []
    measured = memory.is_cuda(device) and states_at is None
    for m in divisors_desc(per_process):
        states = whole if states_at is None else states_at(m)
        batch = _batch(dataset, collator, longest_rows(dataset, m), device)
        if measured:
            try:
                peak = memory.cuda_step_peak(model, batch, loss_fn, device, autocast(mixed_precision, device)) + (
                    states["mem_optimizer_bytes"] + extra_bytes)
                how = "measured (CUDA allocator)"
            except torch.OutOfMemoryError:
                model.zero_grad(set_to_none=True)
                memory.empty_cache()
                probes.append(Probe(m, -1, usable, False, "out of memory"))
                continue
        else:
            with autocast(mixed_precision, device):
                peak = sum(states.values()) + sum(memory.saved_bytes(model, batch, loss_fn).values()) + extra_bytes
            how = "breakdown" if states_at is None else "breakdown, one rank's shards"
        del batch
        probes.append(Probe(m, int(peak), usable, peak <= usable, how))
        if peak <= usable:
            return m, probes
    raise UserError(f"train.memory_budget_gib: not even a micro-batch of 1 fits: it needs "
                    f"{gib(probes[-1].peak_bytes)} of {gib(usable)} usable "
                    f"({SAFETY:.0%} of the budget); raise the budget, turn gradient_checkpointing on, "
                    "or shorten data.max_length")


def budget_bytes(memory_budget_gib: float | None, device: str) -> int:
    """The budget in bytes: the param, or on CUDA the device's free memory when it is null.

    Raises:
        ConfigError: null on CPU (nothing runs out of memory there by itself, so a budget must be given).
    """
    if memory_budget_gib is not None:
        return int(memory_budget_gib * GiB)
    if memory.is_cuda(device):
        return memory.free_bytes(device)
    raise ConfigError("params.yaml: train.memory_budget_gib: is required with per_device_train_batch_size: "
                      "auto on CPU (no device memory to read); give the GiB the training step may use")


def format_probes(probes: list[Probe]) -> str:
    """A Markdown table of the probes (terminal and MLflow artifact)."""
    return markdown_table(["micro-batch", "peak (MiB)", "usable (MiB)", "fits", "how"],
                          [[p.micro_batch, mib(None if p.peak_bytes < 0 else p.peak_bytes, unit=False),
                            mib(p.usable_bytes, unit=False), "yes" if p.fits else "no", p.how] for p in probes])


def autocast(mixed_precision: str, device: str = "cpu"):
    """The autocast context a training step runs its forward pass under, for ``train.mixed_precision``
    (:attr:`onegpu.config.TrainConfig.mixed_precision`: ``"bf16"``, ``"fp16"`` or ``"no"``).

    ``bf16`` / ``fp16``: ``torch.autocast(device type, dtype=torch.bfloat16 / torch.float16)``, as
    Accelerate wraps the model's forward (``Accelerator(mixed_precision=...)``, also under HF Trainer):
    matmul outputs, and so most tensors saved for backward, are 2 bytes instead of 4. ``"no"``: a context
    that does nothing. fp16 autocast runs on CPU too (torch >= 2.3), so an estimate made on CPU sees the
    activation dtypes a CUDA fp16 run saves.
    Raises:
        ValueError: another ``mixed_precision`` value.
    """
    import contextlib

    import torch
    if mixed_precision == "no":
        return contextlib.nullcontext()
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16}
    if mixed_precision not in dtypes:
        raise ValueError(f"mixed_precision must be 'bf16', 'fp16' or 'no', got {mixed_precision!r}")
    return torch.autocast(device_type=str(device).split(":")[0], dtype=dtypes[mixed_precision])


def activation_line(model, dataset, collator, loss_fn, device: str = "cpu",
                    mixed_precision: str = "no") -> tuple[float, float, int, int]:
    """Fit activations(m) = a + b * m from probes of 1 and 2 copies of the longest training row.

    Saved activations grow linearly with the rows of a micro-batch at a fixed padded length (every
    saved tensor has the batch dimension), so two probes fix the line. The probes run under
    :func:`autocast` for ``mixed_precision``, as the training does. Returns (a, b, padded length,
    autocast weight copies): the copies (bytes, :func:`onegpu.measure.memory.saved_bytes`; 0 in fp32) do not
    grow with m and are left out of the line.
    """
    longest = longest_rows(dataset, 1)[0]
    probe = {m: _batch(dataset, collator, [longest] * m, device) for m in (1, 2)}
    with autocast(mixed_precision, device):
        s1 = memory.saved_bytes(model, probe[1], loss_fn)
        a2 = memory.saved_bytes(model, probe[2], loss_fn)["activations"]
    a1 = s1["activations"]
    return float(2 * a1 - a2), float(a2 - a1), int(probe[1]["input_ids"].shape[1]), s1["autocast_weights"]


def estimate(model, dataset, collator, loss_fn, micro_batches: list[int], optim: str,
             checkpointing: bool, enable_checkpointing, device: str = "cpu", mixed_precision: str = "no") -> dict:
    """Predict the memory breakdown per micro-batch, without training.

    Args:
        model: the model as it will train (its attention implementation and LoRA adapters, if any,
            already set: eager attention saves the attention probabilities, SDPA does not).
        micro_batches: the sizes to predict for.
        optim: ``train.optim`` (:func:`optimizer_state_bytes`).
        checkpointing: whether the configured run checkpoints (decides the ``total`` column).
        enable_checkpointing: ``model -> None`` that switches activation checkpointing on.
        mixed_precision: ``train.mixed_precision``; the probes run under :func:`autocast` for it.
            Params, grads and optimizer states stay fp32 under mixed precision (Accelerate and Trainer
            autocast the forward pass; they keep fp32 master weights).
    Returns:
        ``{"states": {...bytes}, "autocast_weights": bytes, "length": padded length, "rows":
        [{micro_batch, activations, activations_checkpointed, total}]}``; every figure in bytes.
        ``autocast_weights``: the bf16/fp16 weight copies the configured run keeps for backward (with
        checkpointing, only those of what runs outside the checkpointed layers), in every total.
    """
    states = state_bytes_predicted(model, optim)
    plain = activation_line(model, dataset, collator, loss_fn, device, mixed_precision)
    enable_checkpointing(model)
    ckpt = activation_line(model, dataset, collator, loss_fn, device, mixed_precision)
    weights = ckpt[3] if checkpointing else plain[3]
    logits = logits_term(model, _batch(dataset, collator, longest_rows(dataset, 1), device), mixed_precision)
    rows = []
    for m in micro_batches:
        a, c = plain[0] + plain[1] * m, ckpt[0] + ckpt[1] * m
        rows.append({"micro_batch": m, "activations": int(a), "activations_checkpointed": int(c),
                     "logits": logits(m),
                     "total": int(sum(states.values()) + weights + (c if checkpointing else a) + logits(m))})
    return {"states": states, "autocast_weights": int(weights), "length": plain[2], "rows": rows}


def logits_term(model, probe: dict, mixed_precision: str = "no"):
    """``m -> bytes``: the output layer's and the loss's memory beyond the saved activations for a
    micro-batch of ``m`` rows like ``probe`` (one collated row, the longest). The whole logits grow with
    the rows (:func:`logits_bytes`); under ``train.fused_lm_head``
    (:func:`onegpu.training.objectives.lm_head.attached`)
    the tiles' temporaries for the targets of ``m`` such rows
    (:func:`onegpu.training.objectives.lm_head.transient_bytes`;
    the gathered hidden states it saves are in the activations already)."""
    from onegpu.training.objectives import lm_head
    from onegpu.training.objectives.loss import count_targets
    if not lm_head.attached(model):
        per_row = logits_bytes(model, int(probe["input_ids"].shape[-1]), mixed_precision)
        return lambda m: per_row * m
    head = model.get_output_embeddings()
    vocab, hidden = head.weight.shape
    targets = int(count_targets(probe["labels"]))
    return lambda m: lm_head.transient_bytes(targets * m, vocab, hidden, head.weight.requires_grad)


def validation_term(model, probe: dict, rows: int) -> int:
    """Bytes a validation (or test) pass's output layer and loss hold at their peak beyond the model's states,
    for batches of ``rows`` rows like ``probe`` (one collated row, the longest of the split), under
    ``torch.no_grad()`` outside autocast as :mod:`onegpu.training.objectives.heldout` runs them: the whole logits,
    their float32 copy and their log-softmax (:func:`logits_bytes` per row), or under ``train.fused_lm_head`` one
    tile's (:func:`onegpu.training.objectives.lm_head.eval_transient_bytes`). 0 for a classifier (its logits are a few
    numbers per row). The layers' own temporaries (one layer's at a time without autograd) are not counted."""
    from onegpu.training.objectives import lm_head
    from onegpu.training.objectives.loss import count_targets
    if not lm_head.attached(model):
        return logits_bytes(model, int(probe["input_ids"].shape[-1])) * rows
    vocab, hidden = model.get_output_embeddings().weight.shape
    return lm_head.eval_transient_bytes(int(count_targets(probe["labels"])) * rows, vocab, hidden)


def logits_bytes(model, length: int, mixed_precision: str = "no") -> int:
    """Bytes per row of a language model's logits that the saved activations leave out: the logits
    (``length x vocab``, 2 bytes under bf16/fp16 autocast, else 4), their float32 copy that the loss
    reads (:func:`onegpu.training.objectives.loss.causal_lm_loss`: ``logits.float()``, or the contiguous copy of the
    shifted slice in fp32) and its float32 gradient in the backward pass; the log-softmax output, which
    autograd saves, is counted in the activations already. At vocab 49,152 (SmolLM2) this is the largest
    activation: 1.5 MiB per token. 0 for a model without output embeddings (a classifier)."""
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(out, "weight", None)
    if weight is None:
        return 0
    own = 4 if mixed_precision == "no" else 2
    return int(length * weight.shape[0] * (own + 4 + 4))


def offloading_line(est: dict, checkpointing: bool) -> str:
    """What ``train.activation_offloading`` saves on the device, per micro-batch of the estimate: its
    activations (as configured: checkpointed or not) move to pinned host memory during each step; the
    device keeps the few in flight (TRL's context holds at most 5) and everything else in the total."""
    key = "activations_checkpointed" if checkpointing else "activations"
    saved = ", ".join(f"{mib(r[key])} at {r['micro_batch']}" for r in est["rows"])
    return (f"train.activation_offloading: the activations move to pinned host memory during each step, so the "
            f"device needs about that much less than the total: {saved} (PCIe traffic instead; CUDA only)")


def sharded_line(est: dict) -> str:
    """The header of an estimate for one rank under FSDP2
    (:func:`onegpu.training.parallel.sharding.per_rank_estimate`)."""
    n = est["ranks"]
    grads = ("whole: gradient_accumulation_steps > 1 holds every gradient unsharded until the step's last "
             "micro-batch" if est["grads_accumulating"] else f"1/{n} each, reduce-scattered every step")
    return (f"per rank of {n} under FSDP2 sharding (train.fsdp.enabled), predicted: params and optimizer states "
            f"1/{n} each (dim-0 shards, rank 0's padded share), grads {grads}, plus the weights all-gathered at "
            f"once ({est['gathered_what']}); activations per micro-batch as without sharding (each rank "
            "runs its own); every figure and total below is per rank")


def format_estimate(est: dict, budget: int | None, checkpointing: bool) -> str:
    """The estimate as a Markdown table, with the largest micro-batch that fits ``budget`` (bytes)."""
    s = est["states"]
    copies = est.get("autocast_weights", 0)
    head = (f"params {mib(s['mem_params_bytes'])} + grads {mib(s['mem_grads_bytes'])} + optimizer "
            f"{mib(s['mem_optimizer_bytes'])}"
            + (f" + all-gathered weights {mib(est['mem_gathered_bytes'])}" if "ranks" in est else "")
            + (f" + autocast's weight copies {mib(copies)} (2 bytes per matmul weight, kept for backward "
               "whatever the micro-batch)" if copies else "")
            + f"; activations at padded length {est['length']} "
            f"(checkpointing {'on' if checkpointing else 'off'} in params)")
    columns = ["micro-batch", "activations (MiB)", "with checkpointing (MiB)", "logits and the loss (MiB)",
               "total as configured (MiB)"]
    fitting = [r["micro_batch"] for r in est["rows"] if budget is not None and r["total"] <= budget * SAFETY]
    rows = [[r["micro_batch"], mib(r["activations"], unit=False), mib(r["activations_checkpointed"], unit=False),
             mib(r.get("logits", 0), unit=False), mib(r["total"], unit=False)]
            + (["yes" if r["micro_batch"] in fitting else "no"] if budget else []) for r in est["rows"]]
    lines = [*([sharded_line(est)] if "ranks" in est else []), head, "",
             markdown_table(columns + (["fits"] if budget else []), rows)]
    if budget:
        lines += ["", f"largest micro-batch that fits {gib(budget)} ({SAFETY:.0%} usable): "
                  + (str(max(fitting)) if fitting else "none of these")]
    return "\n".join(lines)
