"""Activation checkpointing at the granularity ``train.gradient_checkpointing*`` asks for.

Three params (see params.yaml): ``gradient_checkpointing_kwargs.use_reentrant`` (torch's reentrant or
non-reentrant :func:`torch.utils.checkpoint.checkpoint`), ``gradient_checkpointing_kwargs.every_n_layers``
(recompute transformer layers 0, n, 2n, ...; HF's ``every_n_layers``) and
``gradient_checkpointing_blocks``: ``layer`` recomputes the whole chosen layer (transformers' own
checkpointing, as :func:`onegpu.models.loader.enable_checkpointing`), ``attention`` / ``mlp`` only that sub-block
of each chosen layer (its forward wrapped here in ``checkpoint``): BERT-style encoders
(``layer.attention``; ``layer.intermediate`` + ``layer.output`` through ``feed_forward_chunk``) and
GPT-2 (``block.attn``; ``block.mlp``). The recomputation gives the same values: none of this changes
what is computed, only which activations are kept for backward and which are computed twice.
"""
from __future__ import annotations

import functools

from onegpu.errors import ModelError
from onegpu.models import loader


def is_default(train) -> bool:
    """True when ``train`` (a :class:`onegpu.config.TrainConfig`) asks for transformers' whole-layer
    checkpointing (``blocks: layer``), which transformers applies itself (``every_n_layers`` included)."""
    return train.gradient_checkpointing_blocks == "layer"


def hf_kwargs(train) -> dict:
    """``activation_checkpointing_kwargs`` for transformers (``use_reentrant``, and ``every_n_layers``
    when not 1, so the default is exactly ``{"use_reentrant": False}``)."""
    k = train.gradient_checkpointing_kwargs
    out = {"use_reentrant": bool(k.use_reentrant)}
    if k.every_n_layers != 1:
        out["every_n_layers"] = int(k.every_n_layers)
    return out


def enable(model, train) -> None:
    """Switch activation checkpointing on in ``model`` as ``train`` (a ``TrainConfig``) asks.

    ``blocks: layer``: :func:`onegpu.models.loader.enable_checkpointing` (transformers' per-layer checkpointing
    with ``use_reentrant`` and ``every_n_layers``). ``attention`` / ``mlp``: that sub-block of layers
    0, n, 2n, ... runs inside ``torch.utils.checkpoint.checkpoint`` in training mode with grad enabled.

    Raises:
        ModelError: ``attention`` / ``mlp`` on an architecture other than BERT-style encoders and GPT-2.
    """
    if is_default(train):
        loader.enable_checkpointing(model, hf_kwargs(train))
        return
    k = train.gradient_checkpointing_kwargs
    layers = check_supported(model, train)
    loader.no_kv_cache(model)
    if hasattr(model, "enable_input_require_grads"):  # as transformers does when it checkpoints
        model.enable_input_require_grads()
    for i, layer in enumerate(layers):
        if i % k.every_n_layers:
            continue
        if train.gradient_checkpointing_blocks == "attention":
            target = layer.attention if hasattr(layer, "attention") else layer.attn
            target.forward = _checkpointed(target.forward, target, k.use_reentrant)
        elif hasattr(layer, "mlp"):  # GPT-2
            layer.mlp.forward = _checkpointed(layer.mlp.forward, layer.mlp, k.use_reentrant)
        else:  # BERT: intermediate + output, called as feed_forward_chunk(attention_output)
            orig = layer.feed_forward_chunk
            wrapped = _checkpointed(orig, layer, k.use_reentrant)
            # apply_chunking_to_forward counts the parameters of the function: keep exactly one.
            layer.feed_forward_chunk = _one_argument(wrapped)


def check(model, train) -> None:
    """Both checks of ``train.gradient_checkpointing`` on a built ``model`` (a no-op when it is off):
    the model supports activation checkpointing at all (:func:`onegpu.models.loader.supports_checkpointing`)
    and the granularity ``train.gradient_checkpointing_blocks`` asks for (:func:`check_supported`).

    Raises:
        ModelError: either check fails (one line naming the key to change).
    """
    if not train.gradient_checkpointing:
        return
    if not loader.supports_checkpointing(model):
        raise ModelError(f"train.gradient_checkpointing: {type(model).__name__} does not support "
                         "activation checkpointing; set it to false")
    check_supported(model, train)


def check_supported(model, train) -> list:
    """The layers :func:`enable` will use for ``train.gradient_checkpointing_blocks``.

    Raises:
        ModelError: ``attention`` / ``mlp`` on a model that is neither a BERT-style encoder nor GPT-2.
    """
    if is_default(train):
        return []
    layers = transformer_layers(model)
    if not layers:
        blocks = train.gradient_checkpointing_blocks
        raise ModelError(f"train.gradient_checkpointing_blocks: {blocks!r} needs a BERT-style encoder or GPT-2; "
                         f"{type(model).__name__} has neither (use gradient_checkpointing_blocks: layer)")
    return layers


def transformer_layers(model) -> list:
    """The repeated layers of ``model`` whose sub-blocks :func:`enable` can checkpoint, in order: BERT-style
    layers (``attention``, ``intermediate``, ``output``, ``feed_forward_chunk``) and GPT-2 blocks
    (``attn``, ``mlp``); an empty list for other architectures."""
    found = []
    for m in model.modules():
        bert = all(hasattr(m, a) for a in ("attention", "intermediate", "output", "feed_forward_chunk"))
        gpt2 = type(m).__name__ == "GPT2Block" and hasattr(m, "attn") and hasattr(m, "mlp")
        if bert or gpt2:
            found.append(m)
    return found


def _one_argument(fn):
    """``fn`` behind a signature of exactly one parameter (transformers counts them)."""
    def feed_forward_chunk(attention_output):
        return fn(attention_output)
    return feed_forward_chunk


def _checkpointed(forward, module, use_reentrant: bool):
    """``forward`` run through ``torch.utils.checkpoint.checkpoint`` while ``module`` trains with grad on.
    Keyword arguments are passed positionally (the reentrant variant takes no keyword arguments, and
    tensors must be explicit inputs for their gradients to flow)."""
    import torch
    from torch.utils.checkpoint import checkpoint

    @functools.wraps(forward)
    def run(*args, **kwargs):
        if not (module.training and torch.is_grad_enabled()):
            return forward(*args, **kwargs)
        names = list(kwargs)
        n = len(args)

        def call(*flat):
            return forward(*flat[:n], **dict(zip(names, flat[n:])))
        return checkpoint(call, *args, *kwargs.values(), use_reentrant=use_reentrant)
    return run
