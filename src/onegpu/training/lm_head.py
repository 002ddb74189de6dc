"""The LM head only where the loss looks (``train.fused_lm_head``): a causal LM's logits are never whole.

Without it, a causal LM's forward builds the ``(micro_batch, seq_len, vocab)`` logits, the loss a float32
copy and cross-entropy its log-softmax for backward, although most positions of instruction data are
prompt tokens whose label is -100. With it (:func:`attach`), the model's forward in train mode stops at
the decoder's last hidden state (:class:`HiddenStates`, no projection); :func:`target_nll` then gathers
the positions whose next-token label is not -100 and runs the output layer and the cross-entropy over
them in tiles of at most ``TOKENS_PER_TILE x VOCAB_PER_TILE`` logits, keeping only the gathered hidden
states and one log-sum-exp per target for backward, which recomputes each tile. The tiles are TRL's
kernel (``trl.kernels.ChunkedLogProbFunction``, what TRL's ``SFTTrainer`` runs through its
``add_fused_lm_head``): Triton on CUDA, torch elsewhere. The loss is the same sum over the same targets
(:mod:`onegpu.training.loss` divides it by the step's count), so the same training up to summation order.

In eval mode (evaluation, generation) and when the caller passes ``labels``, the forward is the model's own.
"""
from __future__ import annotations

import types
from dataclasses import dataclass

from onegpu.data.chat import IGNORE_INDEX
from onegpu.errors import ModelError

# Vocabulary columns per tile (TRL's default is 32,768; a smaller tile bounds the CPU fallback's float32
# temporaries, several per tile, at 4,096 x 8,192 x 4 bytes = 128 MiB each).
VOCAB_PER_TILE = 8192
# Target positions per tile: TRL's kernel's own (trl.kernels.chunked_logprob.TOKEN_CHUNK_SIZE).
TOKENS_PER_TILE = 4096
# Tile-sized float32 temporaries alive at once in the CPU fallback's backward tile (trl's _backward_tile:
# the recomputed logits, their transform, log-probabilities, probabilities, the one-hot and the gradient).
CPU_TILE_TEMPORARIES = 8
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
    """The patched forward: the model's own in eval mode or with ``labels``; else the backbone alone."""
    if not self.training or kwargs.get("labels") is not None:
        return self._onegpu_full_forward(*args, **kwargs)
    kwargs.pop("num_items_in_batch", None)  # HF Trainer passes it to models that accept loss kwargs
    kwargs["use_cache"] = False
    return HiddenStates(self.base_model(*args, **kwargs).last_hidden_state, self)


def attach(model) -> None:
    """Make ``model`` (a causal LM, or a PEFT model around one) return :class:`HiddenStates` in train mode.

    Idempotent. Call :func:`check` first for a model you did not build: it refuses an output layer this
    path would not reproduce.
    """
    if attached(model):
        return
    inner = _inner(model)
    inner._onegpu_full_forward = inner.forward
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


def target_nll(outputs: HiddenStates, labels):
    """The summed next-token negative log-likelihood over ``labels``' targets: a 0-dim float32 tensor.

    Args:
        outputs: a train-mode forward's :class:`HiddenStates`.
        labels: ``(micro_batch, seq_len)`` int64, unshifted, -100 where no target.
    Position t predicts label t+1 (as :func:`onegpu.training.loss.causal_lm_loss`). One host sync: the
    count of targets (the gathered positions' shape).
    """
    from trl.kernels import ChunkedLogProbFunction
    model = outputs.model
    head = model.get_output_embeddings()
    hidden = outputs.hidden[:, :-1]
    targets = labels[:, 1:].to(hidden.device)
    mask = targets.ne(IGNORE_INDEX)
    scale, softcap = logit_transform(model.config)
    log_probs = ChunkedLogProbFunction.apply(hidden[mask], head.weight, head.bias, targets[mask], 1.0,
                                             VOCAB_PER_TILE, softcap, scale, ("log_probs",))[0]
    return -log_probs.sum()


def transient_bytes(targets: int, vocab: int, hidden: int, compute_bytes: int, head_trains: bool,
                    cuda: bool) -> int:
    """Bytes :func:`target_nll` allocates beyond what it saves for backward, at its peak (the backward of
    its largest tile), for ``targets`` target positions.

    A tile of ``min(targets, TOKENS_PER_TILE) x min(vocab, VOCAB_PER_TILE)`` logits in the compute dtype
    (``compute_bytes``: 2 under bf16/fp16 autocast, else 4); on a CPU, ``CPU_TILE_TEMPORARIES`` float32
    temporaries of that size too (on CUDA, TRL's Triton kernels work in the tile itself); the float32
    gradient of the gathered hidden states (``targets x hidden``) and, when the output layer trains
    (``head_trains``; a tied embedding too), a float32 gradient of its weight (``vocab x hidden``).
    """
    tile = min(targets, TOKENS_PER_TILE) * min(vocab, VOCAB_PER_TILE)
    per_element = compute_bytes + (0 if cuda else 4 * CPU_TILE_TEMPORARIES)
    return int(tile * per_element + 4 * targets * hidden + (4 * vocab * hidden if head_trains else 0))


def attached(model) -> bool:
    """Whether :func:`attach` patched ``model`` (or the model inside its PEFT wrapper)."""
    return getattr(_inner(model), "_onegpu_full_forward", None) is not None
