"""The evaluate stage's figures on the test split (``test_*``, HF ``Trainer.predict``'s prefix): a
classifier's and a causal LM's exact figures (:mod:`onegpu.training.objectives.heldout`, which validation during
training shares), and for instruction data also greedy generations scored by ROUGE-L; which of them comes
from the run's objective (:mod:`onegpu.training.objectives`), not a branch per task. rouge-score and
matplotlib (heavy) are imported where they are used.
"""
from __future__ import annotations

import time

from onegpu import interpreter
from onegpu.config import Config
from onegpu.errors import failure_note as failure_note_of
from onegpu.training import objectives
from onegpu.training.objectives.heldout import TEST, Prediction, causal_lm_metrics, classifier_metrics, predict

__all__ = ["Prediction", "causal_lm_metrics", "classifier_metrics", "predict"]  # held-out figures, re-exported

# The evaluate stage's last line: where to look next after a plain `dvc repro` (`make run` adds its summary).
NEXT = ("evaluate: next: `onegpu ui` (this run's loss and validation figures per step, every run side by side), "
        "`onegpu compare` (which runs trained the same, step by step, and what each cost)")
SHOWN = 3  # generations the evaluate stage prints (instruction data); all are in the run's generations.json


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


def sft_metrics(model, tokenizer, dataset, cfg: Config, device: str, prefix: str = TEST) -> tuple[dict, dict]:
    """Instruction data: :func:`causal_lm_metrics` over the split's target tokens (the completions, under
    ``data.completion_only_loss``; exact over the split) plus a greedy generation per test prompt scored by
    ROUGE-L.

    Returns:
        ``(metrics, table)``: the causal-LM metrics plus ``rouge_l`` (mean F1 over the rows) and
        ``generation_runtime`` (s), under ``prefix``; ``table`` has columns ``prompt`` (decoded, special tokens
        dropped), ``reference``, ``generation``, ``rouge_l``, one entry per row.
    """
    metrics = causal_lm_metrics(model, tokenizer, dataset, cfg, device, prefix)
    start = time.perf_counter()
    generations = generate(model, tokenizer, dataset, cfg.evaluate.max_new_tokens,
                           cfg.evaluate.per_device_eval_batch_size, device)
    scores = rouge_l(dataset["reference"], generations)
    metrics[f"{prefix}_rouge_l"] = sum(scores) / len(scores) if scores else 0.0
    metrics[f"{prefix}_generation_runtime"] = time.perf_counter() - start
    prompts = [tokenizer.decode(ids[:n], skip_special_tokens=True)
               for ids, n in zip(dataset["input_ids"], dataset["prompt_length"])]
    table = {"prompt": prompts, "reference": list(dataset["reference"]), "generation": generations,
             "rouge_l": scores}
    return metrics, table


def as_trained(model, cfg: Config):
    """``model`` (loaded from models/) with the output layer training ran: under ``train.fused_lm_head`` a
    causal LM's held-out loss then comes from the targets' logits in tiles, never the whole logits
    (:func:`onegpu.training.objectives.lm_head.attach`; generation runs the model's own forward). Returns ``model``.
    Raises:
        onegpu.errors.ModelError: an output layer the fused path would not reproduce (as training refused it).
    """
    if objectives.of(cfg).causal_lm and cfg.train.fused_lm_head:
        from onegpu.training.objectives import lm_head
        lm_head.check(model, "models/ (train.fused_lm_head)")
        lm_head.attach(model)
    return model


def metrics(model, tokenizer, test, cfg: Config, device: str) -> tuple[dict, dict | None, list[int], list[int]]:
    """The test split's metrics: ``(metrics, generations table or None, gold, predicted)``, the objective's
    exact figures (:meth:`~onegpu.training.objectives.base.Objective.test_figures`: gold and predicted
    label ids for a classifier, empty for a causal LM); instruction data (a token-level objective, a
    ``reference`` column) adds generation and ROUGE-L (:func:`sft_metrics`). The measured loop collects
    garbage as in any PyTorch process, as training's does (:func:`onegpu.interpreter.settle`)."""
    interpreter.settle()
    objective = objectives.of(cfg)
    if objective.token_level and "reference" in test.column_names:
        return (*sft_metrics(model, tokenizer, test, cfg, device), [], [])
    scores, gold, pred = objective.test_figures(model, tokenizer, test, cfg, device)
    return scores, None, gold, pred


def failure_note(error: BaseException) -> str:
    """The run's description (Markdown) when its evaluation failed or was stopped: what happened, in one line,
    and what to do (the training is done: the pipeline runs the evaluation again)."""
    return failure_note_of(error, "Evaluation", "The training finished and its model is in `models/`: once the "
                           "cause is fixed, `dvc repro` (or the same `dvc exp run`) runs the evaluation again, not "
                           "the training.")


def result_line(task: str, metrics: dict, run_id: str) -> str:
    """``evaluate: <the task's figures>; MLflow run <run_id> finished`` (the objective's
    :meth:`~onegpu.training.objectives.base.Objective.result_line`)."""
    return f"evaluate: {objectives.get(task).result_line(metrics)}; MLflow run {run_id} finished"


def generations_text(table: dict, metrics: dict, max_new_tokens: int) -> str:
    """The first :data:`SHOWN` test generations beside their references, for the terminal (``table`` and
    ``metrics``: :func:`sft_metrics`'s)."""
    rows = len(table["generation"])
    lines = [f"evaluate: greedy generations (at most {max_new_tokens} new tokens) for {rows} test "
             f"prompts in {metrics['test_generation_runtime']:.0f} s; the first {min(SHOWN, rows)} "
             "(all: generations.json in the MLflow run):"]
    for ref, gen, score in list(zip(table["reference"], table["generation"], table["rouge_l"]))[:SHOWN]:
        lines.append(f"  reference:  {ref}\n  generated:  {' '.join(gen.split())}   (ROUGE-L {score:.2f})")
    return "\n".join(lines)


def confusion_figure(gold: list[int], pred: list[int], names: list[str]):
    """The test split's confusion matrix (a ``matplotlib.figure.Figure``; rows actual, columns predicted label,
    each cell's count written in it), drawn as scikit-learn's ``ConfusionMatrixDisplay`` draws it, without
    pyplot or scikit-learn (a second of CPU in the evaluate stage's process)."""
    import numpy as np
    from matplotlib.figure import Figure
    k = len(names)
    counts = np.bincount(np.asarray(gold) * k + np.asarray(pred), minlength=k * k).reshape(k, k)
    fig = Figure(figsize=(6, 5))
    ax = fig.subplots()
    ax.imshow(counts, interpolation="nearest", cmap="viridis")
    middle = (counts.max() + counts.min()) / 2
    for (i, j), n in np.ndenumerate(counts):
        ax.text(j, i, str(n), ha="center", va="center", color="black" if n > middle else "white")
    ax.set(xticks=range(k), yticks=range(k), xticklabels=names, yticklabels=names, xlabel="Predicted label",
           ylabel="True label", title="Test split: actual vs predicted")
    ax.tick_params(axis="x", labelrotation=30)
    fig.tight_layout()
    return fig
