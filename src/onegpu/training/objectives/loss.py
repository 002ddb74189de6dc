"""The loss of one optimizer step, exact under gradient accumulation.

One optimizer step covers an effective batch split into micro-batches. Its loss is the mean over all
the step's *items*: examples for classification, non-padding target tokens for causal LM. Each
micro-batch therefore contributes ``sum of its per-item losses / items in the whole step`` (not its own
mean, which weights items unequally when micro-batches hold different numbers of items, e.g. with
padding). Summed over the step's micro-batches these contributions equal the one-big-batch loss, and
their gradients the one-big-batch gradient, up to float rounding.

Causal LM is shift-aware: position t predicts token t+1, so the first token of each sequence is no
target and labels are counted over ``labels[..., 1:]`` (as in transformers' ``ForCausalLMLoss`` and
``Trainer._get_num_items_in_batch``). Ignored positions carry label -100.
"""
from __future__ import annotations

from onegpu.data.chat import IGNORE_INDEX  # the labels' mask value is data's (data makes the labels)
from onegpu.training.objectives import lm_head


def count_examples(labels):
    """Examples of one micro-batch: ``labels`` ``(micro_batch,)`` not -100; a 0-dim int64 tensor on
    ``labels``' device."""
    return labels.ne(IGNORE_INDEX).sum()


def count_targets(labels):
    """Target tokens of one micro-batch: ``labels`` ``(micro_batch, seq_len)``, unshifted, -100 at padding
    and masked positions; counted over ``labels[..., 1:]`` (position t predicts token t + 1). A 0-dim
    int64 tensor on ``labels``' device."""
    return labels[..., 1:].ne(IGNORE_INDEX).sum()



def classification_loss(outputs, labels, num_items_in_batch=None):
    """Cross-entropy summed over the micro-batch, divided by the optimizer step's example count.

    Args:
        outputs: model output with ``logits`` of shape ``(micro_batch, num_labels)``, any float dtype.
        labels: ``(micro_batch,)`` int64 class ids; -100 marks an ignored row.
        num_items_in_batch: the count of non-ignored labels over *all* micro-batches of the optimizer
            step (HF Trainer computes it in ``Trainer._get_num_items_in_batch``); None = this micro-batch's.
    Returns:
        0-dim float32 tensor (float64 for float64 logits): this micro-batch's share of the step's mean loss.
    """
    import torch.nn.functional as F
    logits = outputs["logits"] if isinstance(outputs, dict) else outputs.logits
    total = F.cross_entropy(lm_head.upcast(logits), labels, ignore_index=IGNORE_INDEX, reduction="sum")
    if num_items_in_batch is None:
        num_items_in_batch = count_examples(labels)
    return total / num_items_in_batch


def causal_lm_loss(outputs, labels, num_items_in_batch=None):
    """Next-token cross-entropy summed over the micro-batch's target tokens, divided by the step's count.

    Args:
        outputs: model output with ``logits`` ``(micro_batch, seq_len, vocab)``, or a model's
            :class:`onegpu.training.objectives.lm_head.HiddenStates` (``train.fused_lm_head``: the same sum, over the
            targets' logits only, :func:`onegpu.training.objectives.lm_head.target_nll`).
        labels: ``(micro_batch, seq_len)`` int64 token ids, unshifted, -100 at padding.
        num_items_in_batch: target tokens (``labels[..., 1:] != -100``) over all micro-batches of the
            optimizer step; None = this micro-batch's.
    Returns:
        0-dim float32 tensor (float64 for float64 logits): this micro-batch's share of the step's mean
        token loss.
    """
    if num_items_in_batch is None:
        num_items_in_batch = count_targets(labels)
    if isinstance(outputs, lm_head.HiddenStates):  # train.fused_lm_head: the targets' logits only, in tiles
        return lm_head.target_nll(outputs, labels) / num_items_in_batch
    import torch.nn.functional as F
    logits = outputs["logits"] if isinstance(outputs, dict) else outputs.logits
    shift_logits = lm_head.upcast(logits[..., :-1, :]).reshape(-1, logits.shape[-1])
    shift_labels = labels[..., 1:].reshape(-1).to(shift_logits.device)
    total = F.cross_entropy(shift_logits, shift_labels, ignore_index=IGNORE_INDEX, reduction="sum")
    return total / num_items_in_batch
