"""Exact figures over a held-out split, the one implementation that the evaluate stage (the test split,
``test_*``: HF ``Trainer.predict``'s prefix, :mod:`onegpu.evaluation`) and validation during training (the
validation split, ``eval_*``: :mod:`onegpu.training.validation`) share: a classifier's loss, accuracy and
macro F1, a causal LM's token loss, perplexity and mean token accuracy.

Every figure is exact over the split: the loss is summed in float64 over all examples (classification) or
all target tokens (causal LM) and divided once by the count, not a mean of per-batch means (HF's
``evaluation_loop`` repeats each batch's mean by its rows: on batches of unequal target counts that is
another figure; ``tests/unit/test_evaluation.py`` shows by how much). Each split is read in batches of
``evaluate.per_device_eval_batch_size`` under ``torch.no_grad()`` with the model in eval mode (no HF
``Trainer``). torch and transformers (heavy) are imported where they are used.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

from onegpu.config import Config
from onegpu.measure import memory
from onegpu.training.batches import CausalLMCollator, model_inputs
from onegpu.training.loss import count_items, loss_for

TEST, EVAL = "test", "eval"  # the metric prefixes: the evaluate stage's test split, validation during training


@dataclass
class Prediction:
    """A classifier over one split: ``logits`` float32 ``(rows, num_labels)`` on the CPU, ``labels`` the
    gold class ids int64 ``(rows,)``, ``loss`` the mean cross-entropy per example (nats,
    :func:`onegpu.training.loss.classification_loss`, summed in float64 over the split), ``runtime`` (s)."""
    logits: object
    labels: object
    loss: float
    runtime: float


def predict(model, tokenizer, dataset, cfg: Config, device: str | None = None) -> Prediction:
    """Run a classifier over ``dataset`` (prepared columns: ``input_ids``, ``attention_mask``, ``label``)
    in order, in batches of ``evaluate.per_device_eval_batch_size`` padded by ``DataCollatorWithPadding``,
    on ``device`` (None: :func:`onegpu.measure.memory.default_device`), under ``torch.no_grad()`` in eval
    mode. Returns its :class:`Prediction`."""
    import torch
    from torch.utils.data import DataLoader
    from transformers import DataCollatorWithPadding
    batches = DataLoader(model_inputs(dataset), batch_size=cfg.evaluate.per_device_eval_batch_size,
                         collate_fn=DataCollatorWithPadding(tokenizer), pin_memory=memory.cuda_available())
    logits, labels = [], []

    def keep(out, gold) -> None:
        logits.append(out.logits.float().cpu())
        labels.append(gold.cpu())

    loss, _, runtime = _summed_loss(model, batches, "sequence-classification", device or memory.default_device(), keep)
    return Prediction(torch.cat(logits), torch.cat(labels), loss, runtime)


def _summed_loss(model, batches, task: str, device: str, keep=None) -> tuple[float, int, float]:
    """The loss of ``task`` summed over every item of ``batches`` (float64) under ``torch.no_grad()`` in
    eval mode, divided once by the item count: ``(mean loss, items, seconds)``. ``keep(out, labels)`` sees
    each batch's model output (the classifier's logits)."""
    import torch
    loss_fn = loss_for(task)
    model.to(device).eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    items = torch.zeros((), dtype=torch.int64, device=device)
    start = time.perf_counter()
    with torch.no_grad():
        for batch in batches:
            batch = {k: v.to(device) for k, v in batch.items()}
            gold = batch.pop("labels")
            out = model(**batch)
            total += loss_fn(out, gold, num_items_in_batch=1).double()  # the batch's sum
            items += count_items(gold, task)
            if keep is not None:
                keep(out, gold)
    return float(total / items), int(items), time.perf_counter() - start


def _named(prefix: str, metrics: dict) -> dict:
    return {f"{prefix}_{k}": v for k, v in metrics.items()}


def f1_macro(gold: list[int], pred: list[int]) -> float:
    """Macro F1 as scikit-learn's ``f1_score(gold, pred, average="macro")`` computes it (checked against it
    in tests/unit/test_evaluation.py), without importing scikit-learn (a second of CPU in every train stage
    that validates): per label in ``gold`` or ``pred``, ``2 TP / (2 TP + FP + FN)``, then their mean."""
    labels = sorted(set(gold) | set(pred))
    if not labels:
        return 0.0
    scores = []
    for label in labels:
        tp = sum(g == p == label for g, p in zip(gold, pred))
        wrong = sum((g == label) != (p == label) for g, p in zip(gold, pred))  # FP + FN
        scores.append(2 * tp / (2 * tp + wrong))
    return sum(scores) / len(scores)


def classifier_metrics(model, tokenizer, dataset, cfg: Config, device: str | None = None, prefix: str = TEST
                       ) -> tuple[dict, list[int], list[int]]:
    """Predict the split (:func:`predict`); return metrics, gold and predicted class ids.

    Metrics, each under ``prefix`` (``test_loss``...): ``loss`` (mean cross-entropy per example, nats),
    ``accuracy``, ``f1_macro`` (:func:`f1_macro`), ``runtime`` (s), ``samples_per_second``, ``rows``.
    """
    out = predict(model, tokenizer, dataset, cfg, device)
    pred, gold = out.logits.argmax(-1).tolist(), out.labels.tolist()
    metrics = {"loss": out.loss, "accuracy": sum(g == p for g, p in zip(gold, pred)) / len(gold),
               "f1_macro": f1_macro(gold, pred), "runtime": out.runtime,
               "samples_per_second": len(gold) / out.runtime, "rows": len(gold)}
    return _named(prefix, metrics), gold, pred


def causal_lm_metrics(model, tokenizer, dataset, cfg: Config, device: str, prefix: str = TEST) -> dict:
    """Next-token loss over every target token of the split, its perplexity and the share of target tokens
    the model ranks first.

    Metrics, each under ``prefix``: ``loss`` (nats per target token), ``perplexity`` = exp(loss),
    ``mean_token_accuracy`` (TRL's name: argmax of the logits = the target, over all target tokens of the
    split), ``runtime`` (s), ``samples_per_second``, ``tokens`` (target tokens), ``rows``.
    """
    from torch.utils.data import DataLoader
    ds = model_inputs(dataset, "causal-lm")
    loader = DataLoader(ds, batch_size=cfg.evaluate.per_device_eval_batch_size,
                        collate_fn=CausalLMCollator(tokenizer))
    correct = []

    def keep(out, gold) -> None:  # next-token hits at the target positions (labels shifted by one)
        targets = gold[..., 1:]
        correct.append(out.logits[..., :-1, :].argmax(-1).eq(targets).logical_and(targets.ne(-100)).sum())

    loss, tokens, runtime = _summed_loss(model, loader, "causal-lm", device, keep)
    hits = int(sum(c.item() for c in correct))
    return _named(prefix, {"loss": loss, "perplexity": math.exp(loss), "mean_token_accuracy": hits / tokens,
                           "runtime": runtime, "samples_per_second": len(ds) / runtime, "tokens": tokens,
                           "rows": len(ds)})


def validation_metrics(model, tokenizer, validation, cfg: Config, device: str) -> dict:
    """The validation split's figures during training, under ``eval_``: a classifier's loss, accuracy and
    macro F1 (:func:`classifier_metrics`), a causal LM's loss, perplexity and mean token accuracy
    (:func:`causal_lm_metrics`; no generation: too slow per point), exact over the split as the test
    split's are. The model is left in eval mode (the caller puts it back)."""
    if cfg.model.task == "causal-lm":
        return causal_lm_metrics(model, tokenizer, validation, cfg, device, EVAL)
    return classifier_metrics(model, tokenizer, validation, cfg, device, EVAL)[0]
