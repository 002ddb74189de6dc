"""The LM head only where the loss looks (``train.fused_lm_head``): a causal LM's logits are never whole.

Without it, a causal LM's forward builds the ``(micro_batch, seq_len, vocab)`` logits, the loss a float32
copy and cross-entropy its log-softmax for backward, although most positions of instruction data are
prompt tokens whose label is -100. With it (:func:`attach`), the model's forward in train mode stops at
the decoder's last hidden state (:class:`HiddenStates`, no projection); :func:`target_nll` then gathers
the positions whose next-token label is not -100 and runs the output layer and the cross-entropy over
them in tiles of :func:`tokens_per_tile` targets x the whole vocabulary, each tile under activation
checkpointing: only the gathered hidden states are kept for backward, which recomputes each tile.

Each tile is the whole-logits path itself on fewer rows (the same projection, logit transform, upcast and
``torch.nn.functional.cross_entropy``), so each target's loss and gradient are computed as the whole
logits compute them, in the same dtype (float64 stays float64): the same training, exactly in float64.
TRL's ``ChunkedLogProbFunction`` (what ``SFTTrainer``'s ``add_fused_lm_head`` runs) is not used: it folds
vocabulary tiles into a float32 ``log_z = max + log(sum exp)`` whatever the inputs' dtype, so a confident
target's gradient ``1 - p`` loses ``ulp(max logit) / (1 - p)`` of its value (on SmolLM2-135M-Instruct's
one-word answers, 1e-4 of the step's gradient in float64, varying with the micro-batch).

In eval mode (evaluation, generation) and when the caller passes ``labels``, the forward is the model's own.

Under ``train.fsdp`` (FSDP2) the output layer belongs to the root's group, which stays gathered from its forward
to its backward (:func:`onegpu.training.parallel.sharding.shard`): read after the forward, ``lm_head.weight`` is the
whole gathered parameter (a tied one the embedding's too), and its tiles' gradient is reduce-scattered with the
root's at the end of backward. Held-out scoring (:func:`hidden_states`) runs through the model's own call, so
that the root's FSDP2 hooks gather it first. A sharded weight (a DTensor) here raises, never computes.
"""
from __future__ import annotations

import types
from dataclasses import dataclass

from onegpu.data.chat import IGNORE_INDEX
from onegpu.errors import ModelError

# Logits per tile (targets x vocabulary): at most 2**24, 64 MiB in float32 (336 targets at SmolLM2's 49,152).
TILE_LOGITS = 1 << 24
# Tile-sized float32 buffers alive together at a tile's backward peak: the log-softmax its backward reads,
# that output's gradient and the logits' gradient (tests/unit/training/objectives/test_lm_head.py measures it).
TILE_BUFFERS = 3
# Rows of a tile are a multiple of this (zero rows, no target, pad the last): a BLAS picks another kernel,
# with another summation order, for a short or ragged matrix (MKL, measured: with AVX2, fewer than 12 rows
# not a multiple of 4; with AVX-512, fewer than 16 rows), and a confident target's gradient ``1 - p``
# magnifies that rounding by ``1 / (1 - p)``. Aligned, each row's projection and gradient are the whole
# logits' to the bit (tests/unit/training).
ROW_ALIGN = 16
# Largest |difference| of :func:`check`'s logits from the model's own, relative to their largest magnitude.
CHECK_REL = 1e-4


@dataclass
class HiddenStates:
    """A train-mode forward's output under :func:`attach`: ``hidden`` ``(micro_batch, seq_len, hidden)``,
    the decoder's last hidden state (after its final norm), and ``model``, whose output layer and logit
    transform :func:`target_nll` applies."""
    hidden: object
    model: object


def logit_transform(config) -> tuple[float, float | None]:
    """``(logit_scale, final_logit_softcapping)`` the model applies after its output layer: logits =
    softcap * tanh(scale * z / softcap) (no tanh when softcap is None), z the projection.

    Read from the (text) config as TRL 1.16's ``add_fused_lm_head`` reads it: ``logit_scale`` (Cohere),
    ``output_multiplier``, ``lm_head_multiplier`` (Falcon-H1), ``1 / logits_scaling`` (Granite, MiniCPM3;
    HyperCLOVA X multiplies by it), ``final_logit_softcapping`` (Gemma 2 and 3)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    scale = getattr(text, "logit_scale", None)
    for name in ("output_multiplier", "lm_head_multiplier"):
        scale = getattr(text, name, None) if scale is None else scale
    scaling = getattr(text, "logits_scaling", None)
    if scale is None and scaling is not None:
        scale = scaling if text.model_type == "hyperclovax" else 1 / scaling
    return (1.0 if scale is None else float(scale)), getattr(text, "final_logit_softcapping", None)


def _inner(model):
    """The transformers model under a PEFT wrapper (or ``model`` itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _forward(self, *args, **kwargs):
    """The patched forward: the model's own in eval mode or with ``labels`` (unless :func:`hidden_states` asks
    for the backbone); else the backbone alone."""
    if not self._onegpu_hidden and (not self.training or kwargs.get("labels") is not None):
        return self._onegpu_full_forward(*args, **kwargs)
    kwargs.pop("num_items_in_batch", None)  # HF Trainer passes it to models that accept loss kwargs
    kwargs["use_cache"] = False
    hidden = self.base_model(*args, **kwargs).last_hidden_state
    if hidden._is_view():
        from torch.distributed.fsdp import FSDPModule  # torch's: sharding's imports would join the reference stage's
        if isinstance(self, FSDPModule):
            # FSDP2 hooks its pre-backward gather onto a sharded root's outputs and warns that an in-place op on a
            # view (GPT-2's last hidden state is one) would drop the hook: a copy of its own (the same values).
            hidden = hidden.clone()
    return HiddenStates(hidden, self)


def attach(model) -> None:
    """Make ``model`` (a causal LM, or a PEFT model around one) return :class:`HiddenStates` in train mode.

    Idempotent. Call :func:`check` first for a model you did not build: it refuses an output layer this
    path would not reproduce.
    """
    if attached(model):
        return
    inner = _inner(model)
    inner._onegpu_full_forward = inner.forward
    inner._onegpu_hidden = False  # True while hidden_states calls the model
    inner.forward = types.MethodType(_forward, inner)


def check(model, model_name: str) -> None:
    """Raises ModelError (one line naming ``model_name`` and the knob) unless the fused path reproduces
    ``model``'s logits: a plain ``torch.nn.Linear`` output layer (not a LoRA-wrapped one) whose output, put
    through :func:`logit_transform`, equals the model's own logits on a short input within ``CHECK_REL``
    (catches a transform before or after the projection that the config does not name)."""
    import torch
    inner = _inner(model)
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    off = "set train.fused_lm_head: false to train it with the whole logits"
    if type(head) is not torch.nn.Linear:
        raise ModelError(f"{model_name}: its output layer is {type(head).__name__}, not a plain Linear that "
                         f"train.fused_lm_head can project in tiles; {off}")
    was_training = inner.training
    inner.eval()
    try:
        with torch.no_grad():
            ids = torch.arange(3, 11, device=head.weight.device).remainder(head.weight.shape[0]).view(1, -1)
            own = inner(input_ids=ids, use_cache=False).logits.float()
            hidden = inner.base_model(input_ids=ids, use_cache=False).last_hidden_state
            ours = _transform(torch.nn.functional.linear(hidden, head.weight, head.bias).float(),
                              *logit_transform(inner.config))
    finally:
        inner.train(was_training)
    err = float((own - ours).abs().max() / own.abs().max().clamp(min=1e-6))
    if not err <= CHECK_REL:
        raise ModelError(f"{model_name} ({inner.config.model_type}): its logits are not its output layer's "
                         f"(relative difference {err:.1e}); {off}")


def _transform(z, scale: float, softcap: float | None):
    import torch
    z = z * scale
    return z if softcap is None else softcap * torch.tanh(z / softcap)


def upcast(logits):
    """``logits`` in the loss's precision: float32, or float64 when they are float64 (a float64 model's
    loss is computed in float64, so that a same-training proof in float64 hides no float32 rounding)."""
    import torch
    return logits if logits.dtype == torch.float64 else logits.float()


def tokens_per_tile(vocab: int) -> int:
    """Target positions per tile: ``TILE_LOGITS // vocab`` rounded down to a multiple of ``ROW_ALIGN``,
    at least ``ROW_ALIGN``."""
    return max(ROW_ALIGN, TILE_LOGITS // vocab // ROW_ALIGN * ROW_ALIGN)


def _tile_nll(hidden, weight, bias, targets, scale: float, softcap: float | None):
    """Summed cross-entropy of ``hidden`` ``(n, hidden)``'s logits against ``targets`` ``(n,)``."""
    import torch.nn.functional as F
    logits = _transform(F.linear(hidden, weight, bias), scale, softcap)
    return F.cross_entropy(upcast(logits), targets, reduction="sum")


def _output_layer(model):
    """``model``'s output layer (``get_output_embeddings()``), its weight whole.

    Raises:
        RuntimeError: the weight is a DTensor: FSDP2 holds only this process's shard of it (read outside the
            root's gathered span: :func:`onegpu.training.parallel.sharding.shard`).
    """
    import sys
    head = model.get_output_embeddings()
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)  # (imported where sharded)
    if dtensor is not None and isinstance(head.weight, dtensor):
        raise RuntimeError("the fused LM head found the output layer's weight sharded (a DTensor): FSDP2's root "
                           "must be gathered when the tiles project (onegpu.training.parallel.sharding.shard)")
    return head


def _gathered(outputs: HiddenStates, labels):
    """``(hidden, targets)``: the hidden states ``(n, hidden)`` of the positions whose next-token label is
    a target and those labels ``(n,)``, padded with zero rows (label -100) to a multiple of ``ROW_ALIGN``."""
    import torch.nn.functional as F
    targets = labels[:, 1:].to(outputs.hidden.device)
    mask = targets.ne(IGNORE_INDEX)
    hidden, targets = outputs.hidden[:, :-1][mask], targets[mask]
    pad = -targets.shape[0] % ROW_ALIGN  # zero rows without a target: an aligned matrix (ROW_ALIGN)
    if pad:  # (a copy of the gathered rows: only when it changes them)
        hidden, targets = F.pad(hidden, (0, 0, 0, pad)), F.pad(targets, (0, pad), value=IGNORE_INDEX)
    return hidden, targets


def target_nll(outputs: HiddenStates, labels):
    """The summed next-token negative log-likelihood over ``labels``' targets: a 0-dim float32 tensor
    (float64 for a float64 model).

    Args:
        outputs: a train-mode forward's :class:`HiddenStates`.
        labels: ``(micro_batch, seq_len)`` int64, unshifted, -100 where no target.
    Position t predicts label t+1 (as :func:`onegpu.training.objectives.loss.causal_lm_loss`). One host sync: the
    count of targets (the gathered positions' shape), padded to a multiple of ``ROW_ALIGN`` rows. Tiles of
    :func:`tokens_per_tile` targets, each under
    ``torch.utils.checkpoint`` (non-reentrant: autocast is recomputed as it was).
    """
    from torch.utils.checkpoint import checkpoint
    model = outputs.model
    head = _output_layer(model)
    hidden, targets = _gathered(outputs, labels)
    scale, softcap = logit_transform(model.config)
    step = tokens_per_tile(head.weight.shape[0])
    tiles = [checkpoint(_tile_nll, hidden[i:i + step], head.weight, head.bias, targets[i:i + step], scale, softcap,
                        use_reentrant=False, preserve_rng_state=False) for i in range(0, targets.shape[0], step)]
    return sum(tiles[1:], tiles[0]) if tiles else upcast(hidden.sum())  # no target: 0, still in the graph


def _tile_token_nll(hidden, weight, bias, targets, scale: float, softcap: float | None):
    """Each row's cross-entropy of ``hidden`` ``(n, hidden)``'s logits against ``targets`` ``(n,)``: ``(n,)``."""
    import torch.nn.functional as F
    logits = _transform(F.linear(hidden, weight, bias), scale, softcap)
    return F.cross_entropy(upcast(logits), targets, reduction="none")


def token_nll(outputs: HiddenStates, labels):
    """Each target's next-token negative log-likelihood, in the order of ``labels[:, 1:] != -100`` (row by
    row), then 0 for each zero row that aligns the tail (:data:`ROW_ALIGN`): a 1-D float32 tensor (float64 for
    a float64 model) of the targets' count rounded up; the caller, who gathered the targets, slices them.

    Args:
        outputs: a forward's :class:`HiddenStates` (train mode under :func:`attach`, or :func:`hidden_states`).
        labels: ``(rows, seq_len)`` int64, unshifted, -100 where no target.
    Tiles as :func:`target_nll` (each target's loss computed as the whole logits compute it), each under
    ``torch.utils.checkpoint`` while autograd records; one host sync (:func:`_gathered`'s).
    """
    import torch
    from torch.utils.checkpoint import checkpoint
    model = outputs.model
    head = _output_layer(model)
    hidden, targets = _gathered(outputs, labels)
    scale, softcap = logit_transform(model.config)
    step = tokens_per_tile(head.weight.shape[0])
    tiles = []
    for i in range(0, targets.shape[0], step):
        args = (hidden[i:i + step], head.weight, head.bias, targets[i:i + step], scale, softcap)
        tiles.append(checkpoint(_tile_token_nll, *args, use_reentrant=False, preserve_rng_state=False)
                     if torch.is_grad_enabled() else _tile_token_nll(*args))
    return torch.cat(tiles) if tiles else upcast(hidden.new_zeros((0,)))


def hidden_states(model, batch: dict) -> HiddenStates:
    """The decoder's last hidden state for ``batch`` (the model's inputs, no ``labels``), in the model's
    current mode: what a train-mode forward returns under :func:`attach`, for held-out figures under
    ``torch.no_grad()`` in eval mode (the same output layer in tiles as training, never the whole logits).

    An attached ``model`` (:func:`attach`; a PEFT model or the model itself, not a DDP wrapper) is called as a
    whole, its patched forward told to stop at the backbone: a sharded model's FSDP2 hooks run (the root's gathers
    the embeddings, final norm and head, which a call of the backbone alone finds sharded: "aten.embedding.default
    got mixed torch.Tensor and DTensor"). Another model's backbone is called alone (a plain model's figures).
    """
    inner = _inner(model)
    if not attached(model):
        return HiddenStates(inner.base_model(**batch, use_cache=False).last_hidden_state, inner)
    inner._onegpu_hidden = True
    try:
        return model(**batch, use_cache=False)
    finally:
        inner._onegpu_hidden = False


def target_scores(outputs: HiddenStates, labels):
    """``(summed nll, hits)`` over ``labels``' targets, tile by tile as :func:`target_nll` computes each
    target's loss (no autograd: call under ``torch.no_grad()``). ``summed nll``: 0-dim float32 (float64 for
    a float64 model); ``hits``: 0-dim int64, the targets whose logit is the largest (TRL's mean token
    accuracy's numerator). ``labels``: ``(rows, seq_len)`` int64, unshifted, -100 where no target."""
    import torch
    model = outputs.model
    head = _output_layer(model)
    hidden, targets = _gathered(outputs, labels)
    scale, softcap = logit_transform(model.config)
    step = tokens_per_tile(head.weight.shape[0])
    nll = upcast(hidden.new_zeros(()))
    hits = torch.zeros((), dtype=torch.int64, device=hidden.device)
    for i in range(0, targets.shape[0], step):
        logits = _transform(torch.nn.functional.linear(hidden[i:i + step], head.weight, head.bias), scale, softcap)
        nll = nll + torch.nn.functional.cross_entropy(upcast(logits), targets[i:i + step], reduction="sum")
        hits += logits.argmax(-1).eq(targets[i:i + step]).sum()
    return nll, hits


def last_logits(outputs: HiddenStates, keep: int):
    """The logits of the last ``keep`` positions of a forward's :class:`HiddenStates`, ``(rows, keep, vocab)`` in the
    model's dtype: its output layer and logit transform (:func:`logit_transform`) applied as the model's own
    forward with ``logits_to_keep=keep`` applies them (whole logits of those positions, not tiles: GRPO's
    log-probabilities at a sampling temperature, :func:`onegpu.training.objectives.generation.token_logps`)."""
    import torch.nn.functional as F
    head = _output_layer(outputs.model)
    scale, softcap = logit_transform(outputs.model.config)
    return _transform(F.linear(outputs.hidden[:, -keep:], head.weight, head.bias), scale, softcap)


def transient_bytes(targets: int, vocab: int, hidden: int, head_trains: bool) -> int:
    """Bytes :func:`target_nll` allocates beyond what it saves for backward, at its peak (the backward of
    its largest tile), for ``targets`` target positions, on any device and in any precision.

    The largest tile has ``min(targets rounded up to ROW_ALIGN, tokens_per_tile(vocab)) x vocab`` logits;
    at its backward's peak ``TILE_BUFFERS`` float32 buffers of that size are alive (under bf16/fp16
    autocast the logits' float32 upcast is freed by then and their 2-byte gradient comes after the float32
    one: the same peak), or, when the output layer trains (``head_trains``; a tied embedding too), the
    logits' float32 gradient and the float32 gradient of its weight (``vocab x hidden``), whichever is
    larger; plus the float32 gradient of the gathered hidden states (``targets x hidden``).
    """
    rows = min(-(-targets // ROW_ALIGN) * ROW_ALIGN, tokens_per_tile(vocab))
    tile = rows * vocab
    peak = max(tile * 4 * TILE_BUFFERS, tile * 4 + (4 * vocab * hidden if head_trains else 0))
    return int(peak + 4 * targets * hidden)


def eval_transient_bytes(targets: int, vocab: int, hidden: int) -> int:
    """Bytes :func:`target_scores` allocates at its peak for ``targets`` target positions (held-out figures,
    no autograd): its largest tile's float32 logits and their log-softmax (``2 x rows x vocab x 4``, rows
    as in :func:`transient_bytes`), plus the gathered hidden states (``targets x hidden x 4``)."""
    rows = min(-(-targets // ROW_ALIGN) * ROW_ALIGN, tokens_per_tile(vocab))
    return int(2 * 4 * rows * vocab + 4 * targets * hidden)


def attached(model) -> bool:
    """Whether :func:`attach` patched ``model`` (or the model inside its PEFT wrapper)."""
    return getattr(_inner(model), "_onegpu_full_forward", None) is not None
