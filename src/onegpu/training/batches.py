"""Micro-batches: the model's columns, the collators and the activation probe's batch.

Shared by both backends, the ``auto`` finder, ``onegpu estimate`` and evaluation; no backend imports.
"""
from __future__ import annotations

# Columns the model consumes; prepare's other columns (text, length) are dropped before training.
MODEL_COLUMNS = ("input_ids", "attention_mask", "token_type_ids", "labels")


def model_inputs(dsd, task: str = "sequence-classification"):
    """The prepared dataset(s) reduced to the model's columns.

    Classification: ``label`` renamed ``labels``. Causal LM: the label column is dropped (the collator
    makes token labels). Works on a ``DatasetDict`` or a single ``Dataset``.
    """
    if task == "causal-lm":
        dsd = dsd.remove_columns("label")
    else:
        dsd = dsd.rename_column("label", "labels")
    cols = dsd.column_names if hasattr(dsd, "features") else dsd["train"].column_names
    return dsd.remove_columns([c for c in cols if c not in MODEL_COLUMNS])


class CausalLMCollator:
    """Pads a micro-batch to its longest row; ``labels`` = ``input_ids`` with -100 at padding.

    Unlike ``DataCollatorForLanguageModeling``, it never masks a real EOS token when pad == EOS.
    Labels are unshifted: the loss shifts them (:func:`onegpu.training.loss.causal_lm_loss`).
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def __call__(self, features: list[dict]) -> dict:
        batch = self.tokenizer.pad(features, return_tensors="pt")
        labels = batch["input_ids"].clone()
        labels[batch["attention_mask"] == 0] = -100
        batch["labels"] = labels
        return batch


def collator_for(task: str, tokenizer):
    """The micro-batch collator for ``task`` (padding per micro-batch)."""
    if task == "causal-lm":
        return CausalLMCollator(tokenizer)
    from transformers import DataCollatorWithPadding
    return DataCollatorWithPadding(tokenizer)


def probe_batch(train_ds, collator, micro_batch: int) -> dict:
    """One micro-batch for the activation probe: the first ``micro_batch`` rows (int, the resolved
    ``per_device_train_batch_size``).

    Taken by index, not from the training DataLoader, so the sampler's RNG is untouched.
    """
    n = min(micro_batch, len(train_ds))
    return collator([train_ds[i] for i in range(n)])


def training_rows(dsd, task: str):
    """``dsd['train']`` reduced to the model's columns, with the ``length`` column kept when prepare wrote
    one (the ``auto`` finder and the estimate pick the longest rows by it)."""
    rows = model_inputs(dsd, task)["train"]
    if "length" in dsd["train"].column_names:
        rows = rows.add_column("length", dsd["train"]["length"])
    return rows
