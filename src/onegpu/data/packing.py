"""Packing (``data.packing``, TRL's name): training examples packed into rows of ``data.max_length`` tokens.

TRL's best-fit-decreasing packer (``trl.data_utils.pack_dataset(strategy="bfd")``) fills each row with whole
examples (sorted by length, each into the row it fits best) and records their lengths (``seq_lengths``);
the padding-free collator (:class:`onegpu.training.objectives.batches.PaddingFreeCollator`) then restarts the
position ids at each example, so attention and next-token targets never cross from one example into
another. Rows are shuffled with ``train.seed`` before packing (TRL's ``shuffle_dataset``: it decides
which of equally long examples share a row).

**What packing changes.** A micro-batch is ``per_device_train_batch_size`` packed *rows* (as in TRL), so an
optimizer step holds a varying number of examples and other examples share a step than without packing.
The loss stays the exact mean over the step's target tokens, but over another grouping of examples into
steps, and an epoch has fewer steps: it is another training, with its own equivalence key (the key holds
``data.packing``), not the same training and not the same in expectation for per-step comparison. The
effective batch is counted in packed rows (``resolved.effective_batch_size``); each step logs the
examples it held (``step_examples``) and its tokens.
"""
from __future__ import annotations


def pack(rows, max_length: int, seed: int):
    """``rows`` (``input_ids``, and ``labels`` when the data masks its loss) packed into rows of at most
    ``max_length`` tokens: columns ``input_ids``, ``labels``, ``seq_lengths`` (a ``datasets.Dataset``).

    Examples are never cut (prepare truncated them to ``max_length`` already); text data without a
    ``labels`` column gets ``labels`` = ``input_ids`` (every token a target, as the padded collator).
    """
    from trl.data_utils import pack_dataset
    if "labels" not in rows.column_names:
        rows = rows.add_column("labels", rows["input_ids"])
    rows = rows.select_columns(["input_ids", "labels"]).shuffle(seed=seed).flatten_indices()
    return pack_dataset(rows, max_length, strategy="bfd")
