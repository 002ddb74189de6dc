"""Sequence classification (``model.task: sequence-classification``): one label per row, the items are
the rows; cross-entropy over the classes (:func:`onegpu.training.objectives.loss.classification_loss`), accuracy and
macro F1 held out (:mod:`onegpu.training.objectives.heldout`)."""
from __future__ import annotations

from onegpu.training.objectives.base import Objective
from onegpu.training.objectives.batches import classifier_columns


class SequenceClassification(Objective):
    task = "sequence-classification"
    # Rows whose label is not -100: ``labels`` ``(rows,)`` int64.
    items_fn, loss_fn = "count_examples", "classification_loss"

    def model_inputs(self, dsd):
        """``label`` renamed ``labels``; the other prepared columns (text, length) dropped."""
        return classifier_columns(dsd)

    def collator(self, tokenizer, flattened: bool = False):
        """Each micro-batch padded to its longest row (``DataCollatorWithPadding``; nothing to flatten)."""
        from transformers import DataCollatorWithPadding
        return DataCollatorWithPadding(tokenizer)

    def heldout_metrics(self, model, tokenizer, dataset, cfg, device: str, prefix: str) -> dict:
        from onegpu.training.objectives import heldout
        return heldout.classifier_metrics(model, tokenizer, dataset, cfg, device, prefix)[0]

    def test_figures(self, model, tokenizer, dataset, cfg, device: str) -> tuple[dict, list[int], list[int]]:
        from onegpu.training.objectives import heldout
        return heldout.classifier_metrics(model, tokenizer, dataset, cfg, device, heldout.TEST)

    def result_line(self, metrics: dict) -> str:
        m = metrics
        return (f"accuracy {m['test_accuracy']:.4f}, f1_macro {m['test_f1_macro']:.4f}, loss {m['test_loss']:.4f} "
                f"on {m['test_rows']} test rows")


OBJECTIVE = SequenceClassification()
