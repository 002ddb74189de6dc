"""Micro-batches: the model's columns, the collators and the activation probe's batch.

Shared by both backends, the ``auto`` finder, ``onegpu estimate`` and evaluation; no backend imports.
"""
from __future__ import annotations

from onegpu.data.chat import IGNORE_INDEX

# Columns the model consumes; prepare's other columns (text, length) are dropped before training.
# Instruction data brings its own ``labels`` (-100 where the loss is masked); packed rows ``seq_lengths``.
MODEL_COLUMNS = ("input_ids", "attention_mask", "token_type_ids", "labels", "seq_lengths")



def keep_model_columns(dsd):
    """``dsd`` (a ``DatasetDict`` or a ``Dataset``) without the columns no model consumes (:data:`MODEL_COLUMNS`)."""
    cols = dsd.column_names if hasattr(dsd, "features") else dsd["train"].column_names
    return dsd.remove_columns([c for c in cols if c not in MODEL_COLUMNS])


def classifier_columns(dsd):
    """A classifier's model inputs: ``label`` renamed ``labels``, the other prepared columns (text, length)
    dropped (a ``DatasetDict`` or a ``Dataset``)."""
    return keep_model_columns(dsd.rename_column("label", "labels"))


def causal_lm_columns(dsd):
    """A causal LM's model inputs: the class column dropped (the collator makes token labels, or the rows
    bring theirs; a ``DatasetDict`` or a ``Dataset``)."""
    return keep_model_columns(dsd.remove_columns("label"))


class CausalLMCollator:
    """Pads a micro-batch to its longest row; ``labels`` = ``input_ids`` with -100 at padding, or the
    rows' own ``labels`` (instruction data: -100 on masked tokens) padded with -100.

    Padding is masked by position (the attention mask), never by token id, so a real EOS token stays a
    target when pad == EOS (``DataCollatorForLanguageModeling`` with ``mlm=False`` masks every pad id).
    Labels are unshifted: the loss shifts them (:func:`onegpu.training.objectives.loss.causal_lm_loss`).
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def __call__(self, features: list[dict]) -> dict:
        import torch
        own = [f["labels"] for f in features] if "labels" in features[0] else None
        if own is not None:
            features = [{k: v for k, v in f.items() if k != "labels"} for f in features]
        batch = self.tokenizer.pad(features, return_tensors="pt")
        if own is None:
            labels = batch["input_ids"].clone()
            labels[batch["attention_mask"] == 0] = IGNORE_INDEX
        else:
            labels = torch.full_like(batch["input_ids"], IGNORE_INDEX)
            width = labels.shape[1]
            for i, row in enumerate(own):
                at = slice(0, len(row)) if self.tokenizer.padding_side == "right" else slice(width - len(row), width)
                labels[i, at] = torch.as_tensor(row)
        batch["labels"] = labels
        return batch


class PaddingFreeCollator:
    """TRL's padding-free batch (``DataCollatorForLanguageModeling(padding_free=True)``): the micro-batch's
    rows concatenated into one row of ``input_ids``, ``labels`` and ``position_ids`` that restart at 0 for
    each sequence, no attention mask and no padding.

    transformers then builds a block-diagonal causal mask from the position ids (``masking_utils.
    find_packed_sequence_indices``, SDPA and eager; flash_attention_2 runs varlen), so no token attends
    across a sequence boundary; each sequence's first label is -100, so no prediction crosses one either
    (the last token of a sequence does not predict the next sequence's first). Packed rows
    (``seq_lengths``, :func:`onegpu.data.packing.pack`) restart their positions at each of their sequences.
    Labels: the rows' own, or ``input_ids``. Output tensors are ``(1, total tokens)`` int64.
    """

    def __call__(self, features: list[dict]) -> dict:
        import torch
        ids, labels, positions = [], [], []
        for f in features:
            row = torch.as_tensor(f["input_ids"], dtype=torch.long)
            ids.append(row)
            labels.append(torch.as_tensor(f.get("labels", f["input_ids"]), dtype=torch.long))
            lengths = f.get("seq_lengths") or [len(row)]
            positions.extend(torch.arange(n, dtype=torch.long) for n in lengths)
        batch = {"input_ids": torch.cat(ids)[None], "labels": torch.cat(labels)[None],
                 "position_ids": torch.cat(positions)[None]}
        batch["labels"][batch["position_ids"] == 0] = IGNORE_INDEX
        return batch


def rows_as_they_are(features: list[dict]) -> list[dict]:
    """The training DataLoader's ``collate_fn`` under several processes: a micro-batch's rows uncollated, so
    that the loop can leave out the rows :func:`own_rows` says are repeats before it collates them."""
    return features


def own_rows(batch: int, rank: int, world: int, micro: int, rows: int) -> int:
    """How many rows of process ``rank``'s ``batch``-th micro-batch of an epoch (0-based) are the epoch's own.

    Accelerate deals an epoch's micro-batches of ``micro`` rows round-robin (micro-batch ``g`` of the epoch's
    order to process ``g % world``) and, with ``even_batches`` (its default and Trainer's), fills the last
    short one and the missing ones of the last round with rows repeated from the epoch's start, at their
    tail (``accelerate.data_loader.BatchSamplerShard._iter_with_no_split``): process ``rank``'s micro-batch
    ``batch`` is the epoch's ``g = batch * world + rank``-th, whose first ``rows - g * micro`` rows (between 0
    and ``micro``) are its own. Repeats would be trained on twice in the step one process trains once; left out,
    N processes train every step on the rows one process does.
    """
    return max(0, min(micro, rows - (batch * world + rank) * micro))


def collate_own(features: list[dict], own: int, collator) -> tuple[dict, bool]:
    """``(micro-batch, counted)``: the first ``own`` of ``features`` collated (the repeats at the tail left
    out, :func:`own_rows`); with none of its own, every row collated and ``counted`` False: the micro-batch is
    only run to keep the processes' collectives in step, its loss weighed by 0
    (:meth:`~onegpu.training.objectives.base.Objective.pad_loss`)."""
    return (collator(features[:own]), True) if own else (collator(features), False)


def own_micro_batches(raw: list[list[dict]], first: int, rank: int, world: int, micro: int, rows: int, collator,
                      device) -> tuple[list[dict], list[bool]]:
    """A step's uncollated micro-batches (``raw``: this process's ``first``-th of the epoch onwards, ``rows`` the
    epoch's) collated without accelerate's repeats (:func:`own_rows`, :func:`collate_own`), on ``device``; and
    for each whether it holds rows of its own (False: repeats only, its loss weighs 0). Both backends' loop."""
    out, counted = [], []
    for j, features in enumerate(raw):
        batch, own = collate_own(features, own_rows(first + j, rank, world, micro, rows), collator)
        out.append({k: v.to(device) for k, v in batch.items()})
        counted.append(own)
    return out, counted



def probe_batch(train_ds, collator, micro_batch: int) -> dict:
    """One micro-batch for the activation probe: the first ``micro_batch`` rows (int, the resolved
    ``per_device_train_batch_size``).

    Taken by index, not from the training DataLoader, so the sampler's RNG is untouched.
    """
    n = min(micro_batch, len(train_ds))
    return collator([train_ds[i] for i in range(n)])
