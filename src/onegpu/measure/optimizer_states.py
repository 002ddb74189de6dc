"""Predicted bytes of an optimizer's states, from the parameters' shapes alone (no optimizer is built):
the arithmetic the memory estimate (:mod:`onegpu.training.memory.autobatch`) and FSDP2's per-rank
prediction (:func:`onegpu.training.parallel.sharding.per_rank_bytes`) share. Each formula names its source;
the measured counterpart is :func:`onegpu.measure.memory.state_bytes`."""
from __future__ import annotations

from onegpu.config import LOW_BIT_OPTIMIZERS, TORCHAO_OPTIMIZERS

# torchao's low-bit AdamW as Trainer (and the accelerate backend) builds it: block size 256 for both.
TORCHAO_BLOCK, TORCHAO_MIN_SIZE = 256, 4096
TORCHAO_QMAP_ENTRIES = {8: 256, 4: 16}  # fp32 entries of each state's own quantization map


def torchao_state_bytes(numel: int, bits: int) -> int:
    """Bytes of torchao's ``AdamW8bit`` (``bits`` 8) or ``AdamW4bit`` (4) states for one parameter of
    ``numel`` elements (``torchao/optim/adam.py``, ``_new_buffer``): a tensor of at least 4,096 elements
    whose count is a multiple of the block size (256) keeps ``exp_avg`` and ``exp_avg_sq`` quantised, each
    ``numel * bits / 8`` bytes of codes, one fp32 scale per block and its own fp32 quantization map (256
    entries at 8 bits, 16 at 4); any other stays two fp32 buffers (``2 * numel * 4``)."""
    if numel < TORCHAO_MIN_SIZE or numel % TORCHAO_BLOCK:
        return 2 * numel * 4
    return 2 * (numel * bits // 8 + 4 * (numel // TORCHAO_BLOCK) + 4 * TORCHAO_QMAP_ENTRIES[bits])


def optimizer_state_bytes(model, optim: str) -> int:
    """Predicted bytes of optimizer states for the trainable parameters, kept in fp32 as torch does.

    AdamW (``adamw_torch``, ``adamw_torch_fused``): ``exp_avg`` + ``exp_avg_sq`` = 2 x trainable bytes
    (torch.optim.AdamW); SGD without momentum (Trainer's default for ``sgd``): 0; Adagrad and RMSprop: one
    buffer; Adafactor (``beta1`` None, as Trainer builds it): for a tensor of 2 or more dims, the factored
    second moment ``exp_avg_sq_row`` (shape[:-1]) + ``exp_avg_sq_col`` (shape[:-2] + shape[-1:]), else
    one full buffer (transformers.optimization.Adafactor ``step``); 0-dim ``RMS``/``step`` are left
    out, as in :func:`onegpu.measure.memory.state_bytes`. ``adamw_bnb_8bit`` (bitsandbytes ``Optimizer2State``
    with ``optim_bits=8``): two uint8 states plus one fp32 absmax per block of 256 for each of them on
    tensors of at least ``min_8bit_size`` = 4096 elements, two fp32 states on smaller ones (the two
    shared 256-entry quantization maps are left out). ``adamw_torch_8bit`` / ``adamw_torch_4bit`` (torchao):
    :func:`torchao_state_bytes`, about a quarter / an eighth of AdamW's on large tensors.
    """
    return sum(tensor_state_bytes(tuple(p.shape), optim) for p in model.parameters() if p.requires_grad)


def tensor_state_bytes(shape: tuple[int, ...], optim: str) -> int:
    """Bytes of ``optim``'s states for one trainable parameter of ``shape`` (:func:`optimizer_state_bytes`'s rules;
    FSDP2 sharding gives it the shape of a rank's dim-0 shard,
    :func:`onegpu.training.parallel.sharding.per_rank_bytes`)."""
    import math
    n = math.prod(shape)
    if optim == "adamw_bnb_8bit":
        return 2 * (n + 4 * math.ceil(n / 256)) if n >= 4096 else 2 * n * 4
    if optim in TORCHAO_OPTIMIZERS:
        return torchao_state_bytes(n, LOW_BIT_OPTIMIZERS[optim])
    if optim.startswith("adamw"):
        return 2 * n * 4
    if optim in ("adagrad", "rmsprop"):
        return n * 4
    if optim == "adafactor":
        return (math.prod(shape[:-1]) + math.prod(shape[:-2] + shape[-1:])) * 4 if len(shape) >= 2 else n * 4
    return 0
