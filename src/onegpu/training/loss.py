"""The loss of one optimizer step, exact under gradient accumulation.

One optimizer step covers an effective batch of B examples split into micro-batches. Its loss is the
mean over all B examples, so each micro-batch contributes ``sum of its per-example losses / B``
(not the mean of per-micro-batch means, which weights examples unequally when micro-batches differ in
size). Summed over the step's micro-batches, the contributions equal the one-big-batch loss, and so do
the accumulated gradients, up to float rounding.
"""
from __future__ import annotations


def classification_loss(outputs, labels, num_items_in_batch=None):
    """Cross-entropy summed over the micro-batch, divided by the optimizer step's example count.

    Args:
        outputs: model output with ``logits`` of shape ``(micro_batch, num_labels)``, any float dtype.
        labels: ``(micro_batch,)`` int64 class ids; -100 marks an ignored row.
        num_items_in_batch: the count of non-ignored labels over *all* micro-batches of the optimizer
            step (HF Trainer computes it in ``Trainer._get_num_items_in_batch``); None = this micro-batch's.
    Returns:
        0-dim float32 tensor: this micro-batch's share of the step's mean loss.
    """
    import torch.nn.functional as F
    logits = outputs["logits"] if isinstance(outputs, dict) else outputs.logits
    total = F.cross_entropy(logits.float(), labels, ignore_index=-100, reduction="sum")
    if num_items_in_batch is None:
        num_items_in_batch = labels.ne(-100).sum()
    return total / num_items_in_batch
