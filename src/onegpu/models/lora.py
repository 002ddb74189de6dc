"""PEFT LoRA (``model.lora``): wrapping a built model in adapters, counting what trains, saving.

LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models") freezes the model and adds
to each targeted linear layer ``W`` (out x in) a trainable update ``(alpha / r) * B @ A`` with ``A``
(r x in) and ``B`` (out x r, zero at the start, so the wrapped model first computes what the model
did). The ``peft`` library does the wrapping; for sequence classification its task type ``SEQ_CLS``
also trains (and saves) the new classification head (``modules_to_save``: ``classifier``/``score``).
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from onegpu import paths
from onegpu.config import LoraConfig, causal_lm
from onegpu.errors import ModelError


def apply(model, lora: LoraConfig, task: str, checkpointing: bool = False):
    """``model`` wrapped in LoRA adapters by ``peft.get_peft_model``; only adapters (and the head) train.

    Args:
        model: a built ``transformers`` model (float32, on CPU); its frozen weights are shared, not copied.
        lora: ``model.lora`` (rank ``r``, ``alpha``, ``dropout``, ``target_modules`` or None = peft's
            default for the architecture, e.g. ``query``/``value`` for BERT, ``c_attn`` for GPT-2).
        task: ``model.task``; a classifier's (no causal LM: ``config.causal_lm``) keeps its head
            trainable (peft's ``SEQ_CLS``), a causal LM's is ``CAUSAL_LM``.
        checkpointing: activation checkpointing will be on. The input embeddings are frozen, so their
            output does not require grad; reentrant checkpointing then gives the adapters inside a
            checkpointed block no gradient, or fails with "element 0 of tensors does not require
            grad". ``enable_input_require_grads`` makes the embedding output require grad (onegpu's
            own checkpointing is non-reentrant, which does not need it, but a model a user passes
            through reentrant checkpointing does).
    Returns:
        A ``peft.PeftModel``. The adapters' ``A`` init draws from torch's RNG (seed first).
    Raises:
        ModelError: a target module name matches no module of the model.
    """
    import warnings

    from peft import LoraConfig as PeftLoraConfig, TaskType, get_peft_model
    task_type = TaskType.CAUSAL_LM if causal_lm(task) else TaskType.SEQ_CLS
    conv1d = _uses_conv1d(model)  # GPT-2 stores weights as (in, out): peft needs fan_in_fan_out=True
    config = PeftLoraConfig(task_type=task_type, r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                            target_modules=list(lora.target_modules) if lora.target_modules else None,
                            fan_in_fan_out=conv1d)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*fan_in_fan_out.*")
            # peft 0.21 reads transformers 5's deprecated `is_gradient_checkpointing` (its FutureWarning is
            # addressed to peft, not to the user)
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            wrapped = get_peft_model(model, config)
    except ValueError as e:
        names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if _adaptable(m)})
        raise ModelError(f"model.lora.target_modules={lora.target_modules!r}: {str(e).splitlines()[0]} "
                         f"(linear layers of {type(model).__name__}: {', '.join(names[:12])})") from None
    if checkpointing:
        wrapped.enable_input_require_grads()
    return wrapped


def _uses_conv1d(model) -> bool:
    from transformers.pytorch_utils import Conv1D
    return any(isinstance(m, Conv1D) for m in model.modules())


def _adaptable(module) -> bool:
    import torch
    from transformers.pytorch_utils import Conv1D
    return isinstance(module, (torch.nn.Linear, Conv1D))


def is_peft(model) -> bool:
    """True for a ``peft.PeftModel`` (a model :func:`apply` wrapped)."""
    return hasattr(model, "peft_config") and hasattr(model, "merge_and_unload")


def trainable_parameters(model) -> int:
    """Number of parameters (elements) with ``requires_grad``: under LoRA the adapters and the head."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def save(model, tokenizer, adapter_dir: str | os.PathLike):
    """The trained model's adapter side, as the train stage writes ``models/``.

    With adapters (:func:`is_peft`): the adapter as trained (``save_pretrained`` of the peft model:
    ``adapter_config.json`` and ``adapter_model.safetensors``, with the head for classification) and the
    ``tokenizer`` into ``adapter_dir``, atomically (:func:`onegpu.paths.atomic_dir`), then the adapter
    merged. Without: a stale ``adapter_dir`` (an earlier LoRA run's, not this model's) removed.

    Returns:
        The plain ``transformers`` model to save as the model: the merged one (``merge_and_unload``:
        ``W + (alpha / r) B @ A`` in each targeted layer, which computes what the adapter model computes;
        ``model`` itself is merged in place and must not be used as a peft model afterwards), or ``model``.
    Raises:
        onegpu.errors.DiskFullError: the disk filled while writing.
    """
    if not is_peft(model):
        shutil.rmtree(adapter_dir, ignore_errors=True)
        return model
    with paths.atomic_dir(Path(adapter_dir)) as tmp:
        model.save_pretrained(str(tmp))
        merged = model.merge_and_unload()
        tokenizer.save_pretrained(tmp)
    return merged
