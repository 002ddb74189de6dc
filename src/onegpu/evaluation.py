"""Test-split metrics: accuracy and macro F1 for classification, token loss and perplexity for causal LM.

Every figure is exact over the split: the loss is the mean over all examples (classification) or all
target tokens (causal LM), not a mean of per-batch means.
"""
from __future__ import annotations

import math
import time

from onegpu.config import Config


def predict(model, tokenizer, dataset, cfg: Config):
    """Run a classifier over ``dataset`` (prepared columns) with HF ``Trainer`` and return its
    ``PredictionOutput``.

    Its ``metrics`` hold ``eval_loss`` (mean cross-entropy per example,
    :func:`onegpu.training.loss.classification_loss`), ``eval_runtime`` (seconds),
    ``eval_samples_per_second``; ``predictions`` are logits ``(rows, num_labels)``; ``label_ids`` the gold ids.
    """
    import tempfile

    from transformers import DataCollatorWithPadding, Trainer, TrainingArguments

    from onegpu import measure
    from onegpu.training.batches import model_inputs
    from onegpu.training.loss import loss_for
    with tempfile.TemporaryDirectory(prefix="onegpu-eval-") as out:  # Trainer wants one; nothing is saved
        args = TrainingArguments(output_dir=out, per_device_eval_batch_size=cfg.evaluate.per_device_eval_batch_size,
                                 report_to="none", remove_unused_columns=False, bf16_full_eval=False,
                                 disable_tqdm=True, dataloader_pin_memory=measure.cuda_available())
        trainer = Trainer(model=model, args=args, data_collator=DataCollatorWithPadding(tokenizer),
                          processing_class=tokenizer, compute_loss_func=loss_for("sequence-classification"))
        return trainer.predict(model_inputs(dataset), metric_key_prefix="eval")


def classifier_metrics(model, tokenizer, dataset, cfg: Config) -> tuple[dict, list[int], list[int]]:
    """Predict the split with HF Trainer; return metrics, gold and predicted class ids.

    Metrics: ``eval_loss`` (mean cross-entropy per example), ``eval_accuracy``, ``eval_f1_macro``
    (scikit-learn), ``eval_runtime`` (s), ``eval_samples_per_second``, ``eval_rows``.
    """
    import numpy as np
    from sklearn.metrics import accuracy_score, f1_score

    out = predict(model, tokenizer, dataset, cfg)
    pred = np.asarray(out.predictions).argmax(-1)
    gold = np.asarray(out.label_ids)
    metrics = {"eval_loss": out.metrics["eval_loss"],
               "eval_accuracy": float(accuracy_score(gold, pred)),
               "eval_f1_macro": float(f1_score(gold, pred, average="macro")),
               "eval_runtime": out.metrics["eval_runtime"],
               "eval_samples_per_second": out.metrics["eval_samples_per_second"],
               "eval_rows": len(gold)}
    return metrics, gold.tolist(), pred.tolist()


def causal_lm_metrics(model, tokenizer, dataset, cfg: Config, device: str) -> dict:
    """Next-token loss over every target token of the split and its perplexity.

    Metrics: ``eval_loss`` (nats per target token), ``eval_perplexity`` = exp(eval_loss),
    ``eval_runtime`` (s), ``eval_samples_per_second``, ``eval_tokens``, ``eval_rows``.
    """
    import torch
    from torch.utils.data import DataLoader

    from onegpu.training.batches import CausalLMCollator, model_inputs
    from onegpu.training.loss import causal_lm_loss, count_items
    ds = model_inputs(dataset, "causal-lm")
    loader = DataLoader(ds, batch_size=cfg.evaluate.per_device_eval_batch_size,
                        collate_fn=CausalLMCollator(tokenizer))
    model.to(device).eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    items = torch.zeros((), dtype=torch.int64, device=device)
    start = time.perf_counter()
    with torch.no_grad():
        for batch in loader:
            batch = {k: v.to(device) for k, v in batch.items()}
            labels = batch.pop("labels")
            out = model(**batch)
            total += causal_lm_loss(out, labels, num_items_in_batch=1).double()
            items += count_items(labels, "causal-lm")
    loss = float(total / items)
    runtime = time.perf_counter() - start
    return {"eval_loss": loss, "eval_perplexity": math.exp(loss), "eval_runtime": runtime,
            "eval_samples_per_second": len(ds) / runtime, "eval_tokens": int(items), "eval_rows": len(ds)}
