"""Test-split metrics: accuracy and macro F1 for classification, token loss and perplexity for causal LM,
and for instruction data also greedy generations scored by ROUGE-L.

Every figure is exact over the split: the loss is the mean over all examples (classification) or all
target tokens (causal LM), not a mean of per-batch means.
"""
from __future__ import annotations

import math
import time

from onegpu.config import Config

SHOWN = 3  # generations the evaluate stage prints (instruction data); all are in the run's generations.json


def predict(model, tokenizer, dataset, cfg: Config):
    """Run a classifier over ``dataset`` (prepared columns) with HF ``Trainer`` and return its
    ``PredictionOutput``.

    Its ``metrics`` hold ``eval_loss`` (mean cross-entropy per example,
    :func:`onegpu.training.loss.classification_loss`), ``eval_runtime`` (seconds),
    ``eval_samples_per_second``; ``predictions`` are logits ``(rows, num_labels)``; ``label_ids`` the gold ids.
    """
    import tempfile

    from transformers import DataCollatorWithPadding, Trainer, TrainingArguments

    from onegpu.measure import memory
    from onegpu.training.batches import model_inputs
    from onegpu.training.loss import loss_for
    with tempfile.TemporaryDirectory(prefix="onegpu-eval-") as out:  # Trainer wants one; nothing is saved
        args = TrainingArguments(output_dir=out, per_device_eval_batch_size=cfg.evaluate.per_device_eval_batch_size,
                                 report_to="none", remove_unused_columns=False, bf16_full_eval=False,
                                 disable_tqdm=True, dataloader_pin_memory=memory.cuda_available())
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


def generate(model, tokenizer, dataset, max_new_tokens: int, batch_size: int, device: str) -> list[str]:
    """Greedy completions (``do_sample=False``, at most ``max_new_tokens`` new tokens, stopping at the
    tokenizer's EOS) of every row's prompt: its first ``prompt_length`` ``input_ids`` (exactly the ids it
    was trained after), left-padded per batch of ``batch_size``. Returns the decoded new text per row,
    special tokens dropped, stripped."""
    import torch
    out, side = [], tokenizer.padding_side
    model.to(device).eval()
    tokenizer.padding_side = "left"  # generation appends on the right: pads go left
    try:
        for start in range(0, len(dataset), batch_size):
            rows = dataset[start:start + batch_size]
            prompts = [{"input_ids": ids[:n]} for ids, n in zip(rows["input_ids"], rows["prompt_length"])]
            batch = {k: v.to(device) for k, v in tokenizer.pad(prompts, return_tensors="pt").items()}
            with torch.no_grad():
                ids = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False,
                                     pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
            new = ids[:, batch["input_ids"].shape[1]:]
            out += [t.strip() for t in tokenizer.batch_decode(new, skip_special_tokens=True)]
    finally:
        tokenizer.padding_side = side
    return out


def rouge_l(references: list[str], generations: list[str]) -> list[float]:
    """ROUGE-L F1 of each generation against its reference (``rouge_score``, Porter stemming: Lin 2004,
    the longest common subsequence of words), in [0, 1]."""
    from rouge_score import rouge_scorer
    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)
    return [scorer.score(r, g)["rougeL"].fmeasure for r, g in zip(references, generations)]


def sft_metrics(model, tokenizer, dataset, cfg: Config, device: str) -> tuple[dict, dict]:
    """Instruction data: :func:`causal_lm_metrics` over the split's target tokens (the completions, under
    ``data.completion_only_loss``; exact over the split) plus a greedy generation per test prompt scored by
    ROUGE-L.

    Returns:
        ``(metrics, table)``: the causal-LM metrics plus ``eval_rouge_l`` (mean F1 over the rows) and
        ``eval_generation_runtime`` (s); ``table`` has columns ``prompt`` (decoded, special tokens
        dropped), ``reference``, ``generation``, ``rouge_l``, one entry per row.
    """
    metrics = causal_lm_metrics(model, tokenizer, dataset, cfg, device)
    start = time.perf_counter()
    generations = generate(model, tokenizer, dataset, cfg.evaluate.max_new_tokens,
                           cfg.evaluate.per_device_eval_batch_size, device)
    scores = rouge_l(dataset["reference"], generations)
    metrics["eval_rouge_l"] = sum(scores) / len(scores) if scores else 0.0
    metrics["eval_generation_runtime"] = time.perf_counter() - start
    prompts = [tokenizer.decode(ids[:n], skip_special_tokens=True)
               for ids, n in zip(dataset["input_ids"], dataset["prompt_length"])]
    table = {"prompt": prompts, "reference": list(dataset["reference"]), "generation": generations,
             "rouge_l": scores}
    return metrics, table


def metrics(model, tokenizer, test, cfg: Config, device: str) -> tuple[dict, dict | None, list[int], list[int]]:
    """The test split's metrics for the task: ``(metrics, generations table or None, gold, predicted)``
    (gold and predicted label ids for a classifier; empty for a causal LM). Instruction data (a
    ``reference`` column) adds generation and ROUGE-L (:func:`sft_metrics`). The measured loop collects
    garbage as in any PyTorch process, as training's does (:func:`onegpu.interpreter.settle`)."""
    from onegpu import interpreter
    interpreter.settle()
    if cfg.model.task == "causal-lm" and "reference" in test.column_names:
        return (*sft_metrics(model, tokenizer, test, cfg, device), [], [])
    if cfg.model.task == "causal-lm":
        return causal_lm_metrics(model, tokenizer, test, cfg, device), None, [], []
    scores, gold, pred = classifier_metrics(model, tokenizer, test, cfg)
    return scores, None, gold, pred


def generations_text(table: dict, metrics: dict, max_new_tokens: int) -> str:
    """The first :data:`SHOWN` test generations beside their references, for the terminal (``table`` and
    ``metrics``: :func:`sft_metrics`'s)."""
    lines = [f"evaluate: greedy generations (at most {max_new_tokens} new tokens) for {len(table['generation'])} test "
             f"prompts in {metrics['eval_generation_runtime']:.0f} s; the first {min(SHOWN, len(table['generation']))} "
             "(all: generations.json in the MLflow run):"]
    for ref, gen, score in list(zip(table["reference"], table["generation"], table["rouge_l"]))[:SHOWN]:
        lines.append(f"  reference:  {ref}\n  generated:  {' '.join(gen.split())}   (ROUGE-L {score:.2f})")
    return "\n".join(lines)


def confusion_figure(gold: list[int], pred: list[int], names: list[str]):
    """The test split's confusion matrix (matplotlib figure; rows actual, columns predicted label)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from sklearn.metrics import ConfusionMatrixDisplay
    fig, ax = plt.subplots(figsize=(6, 5))
    ConfusionMatrixDisplay.from_predictions(gold, pred, labels=list(range(len(names))), display_labels=names,
                                            ax=ax, colorbar=False, xticks_rotation=30)
    ax.set_title("Test split: actual vs predicted")
    fig.tight_layout()
    return fig
