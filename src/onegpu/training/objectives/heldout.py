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
from onegpu.training.objectives import lm_head
from onegpu.training.objectives.batches import CausalLMCollator, causal_lm_columns, classifier_columns
from onegpu.training.objectives.loss import causal_lm_loss, classification_loss, count_examples, count_targets
from onegpu.training.parallel import distributed

TEST, EVAL = "test", "eval"  # the metric prefixes: the evaluate stage's test split, validation during training


@dataclass
class Prediction:
    """A classifier over one split: ``logits`` float32 ``(rows, num_labels)`` on the CPU, ``labels`` the
    gold class ids int64 ``(rows,)``, ``loss`` the mean cross-entropy per example (nats,
    :func:`onegpu.training.objectives.loss.classification_loss`, summed in float64 over the split), ``runtime`` (s)."""
    logits: object
    labels: object
    loss: float
    runtime: float


def predict(model, tokenizer, dataset, cfg: Config, device: str | None = None) -> Prediction:
    """Run a classifier over ``dataset`` (prepared columns: ``input_ids``, ``attention_mask``, ``label``)
    in order, in batches of ``evaluate.per_device_eval_batch_size`` padded by ``DataCollatorWithPadding``,
    on ``device`` (None: :func:`onegpu.measure.memory.default_device`), under ``torch.no_grad()`` in eval
    mode. Under several processes each reads its share of the rows (:func:`shard`) and every process gets
    the whole split's :class:`Prediction` (rows in rank order: the split's order)."""
    import torch
    from transformers import DataCollatorWithPadding
    loader = batches(classifier_columns(dataset), cfg, DataCollatorWithPadding(tokenizer))
    logits, labels = [], []

    def keep(out_logits, gold) -> None:
        logits.append(out_logits.float().cpu())
        labels.append(gold.cpu())

    loss, _, _, runtime = _summed(model, loader, classifier_batch, device or memory.default_device(), keep)
    logits = torch.cat(logits) if logits else torch.zeros(0, model.config.num_labels)  # (an empty share)
    labels = torch.cat(labels) if labels else torch.zeros(0, dtype=torch.int64)
    if len(parts := distributed.gather_objects((logits, labels))) > 1:  # every rank's rows, in rank order
        logits, labels = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    return Prediction(logits, labels, loss, runtime)


def shard(dataset):
    """This process's contiguous share of ``dataset``'s rows under several processes: rank r of W reads
    rows ``[r n // W, (r + 1) n // W)``, so every row is read once and none twice (no padding duplicates,
    as a ``DistributedSampler`` or Accelerate's ``even_batches`` would add for an uneven split; a share may
    be empty). The dataset itself outside an initialized process group (the sums are all-reduced over it)."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return dataset
    world, rank = dist.get_world_size(), dist.get_rank()
    return dataset.select(range(rank * len(dataset) // world, (rank + 1) * len(dataset) // world))


def batches(dataset, cfg: Config, collator, whole: bool = False):
    """This process's share of ``dataset`` (:func:`shard`; ``whole``: every row) in order, in batches of
    ``evaluate.per_device_eval_batch_size`` collated by ``collator``."""
    from torch.utils.data import DataLoader
    rows = dataset if whole else shard(dataset)
    loader = DataLoader(rows, batch_size=cfg.evaluate.per_device_eval_batch_size, collate_fn=collator,
                        pin_memory=memory.cuda_available())
    loader.split = dataset  # the whole split (:func:`_fillers` collates its first row where it needs one)
    return loader


def _fillers(model, loader, done: int, device: str) -> list:
    """Under FSDP2 (``train.fsdp``: every forward gathers the weights with all processes) the forwards this
    process owes after its ``done`` batches: as many as the process with the most batches has more (the
    shares of an uneven split differ by a row, so by a batch at most), each on the split's first row, collated
    (its results are discarded), so that every process runs as many; none without sharding. One all-gather under
    sharding."""
    from onegpu.training.parallel import sharding
    if not sharding.is_sharded(model):
        return []
    owed = max(int(counts[0]) for counts in distributed.gather_over_ranks([done], device)) - done
    return [loader.collate_fn([loader.split[0]])] * owed if owed else []


def classifier_batch(model, batch: dict, gold):
    """One batch's ``(summed cross-entropy, examples, logits)``."""
    out = model(**batch)
    items = count_examples(gold)
    return classification_loss(out, gold, num_items_in_batch=1), items, out.logits


def causal_lm_batch(model, batch: dict, gold):
    """One batch's ``(summed next-token loss, target tokens, hits)``; hits: target tokens the model ranks
    first. Under ``train.fused_lm_head`` (:func:`onegpu.training.objectives.lm_head.attached`) from the targets' logits
    in tiles, as training computes its loss (:func:`onegpu.training.objectives.lm_head.target_scores`), else from the
    whole logits."""
    items = count_targets(gold)
    if lm_head.attached(model):
        nll, hits = lm_head.target_scores(lm_head.hidden_states(model, batch), gold)
        return nll, items, hits
    out = model(**batch)
    targets = gold[..., 1:]  # next-token hits at the target positions (labels shifted by one)
    hits = out.logits[..., :-1, :].argmax(-1).eq(targets).logical_and(targets.ne(-100)).sum()
    return causal_lm_loss(out, gold, num_items_in_batch=1), items, hits


def _summed(model, batches, score, device: str, keep=None) -> tuple[float, int, int, float]:
    """``score(model, batch, gold) -> (summed loss, items, extra)`` over every batch under
    ``torch.no_grad()`` in eval mode, the losses summed in float64 and divided once by the item count,
    over all processes (one all-reduce): ``(mean loss, items, hits, seconds)``. ``extra`` is a 0-dim hit
    count (summed into ``hits``), or handed to ``keep(extra, gold)`` (the classifier's logits; hits 0)."""
    import torch
    model.to(device).eval()
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss, items, hits (counts exact below 2**53)
    start = time.perf_counter()
    owed = _fillers(model, batches, len(batches), device)  # (before the batches: a collective of its own)
    with torch.no_grad():
        for batch in batches:
            batch = {k: v.to(device) for k, v in batch.items()}
            gold = batch.pop("labels")
            loss, items, extra = score(model, batch, gold)
            sums[0] += loss.double()
            sums[1] += items
            if keep is None:
                sums[2] += extra
            else:
                keep(extra, gold)
        for batch in owed:  # counted nowhere
            batch = {k: v.to(device) for k, v in batch.items()}
            score(model, batch, batch.pop("labels"))
    total, items, hits = distributed.sum_over_ranks(sums).tolist()
    return total / items, int(items), int(hits), time.perf_counter() - start


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
    ds = causal_lm_columns(dataset)
    loss, tokens, hits, runtime = _summed(model, batches(ds, cfg, CausalLMCollator(tokenizer)), causal_lm_batch,
                                          device)
    return _named(prefix, {"loss": loss, "perplexity": math.exp(loss), "mean_token_accuracy": hits / tokens,
                           "runtime": runtime, "samples_per_second": len(ds) / runtime, "tokens": tokens,
                           "rows": len(ds)})
