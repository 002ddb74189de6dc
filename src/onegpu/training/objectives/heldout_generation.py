"""GRPO's held-out figures: each prompt of a split answered once, greedily, and scored by the reward functions
(the validation split while training, the test split in the evaluate stage, against the starting model's own).

Greedy decoding (``do_sample`` off) makes the figure a property of the model alone, not of a sampling seed:
a pass rate that moves after training moved because the model did.
"""
from __future__ import annotations

import time

from onegpu.training.objectives import generation, rewards


def greedy(model, prompts: list[list[int]], max_new_tokens: int, pad_token_id: int, eos_token_ids: list[int]):
    """One greedy completion of each prompt: :class:`~onegpu.training.objectives.generation.Generations` (one
    row per prompt; :func:`~onegpu.training.objectives.generation.sample` without a seed); ``model``'s mode is
    restored."""
    return generation.sample(model, prompts, generation.Sampling(1, max_new_tokens), pad_token_id, eos_token_ids,
                             seed=None)


def figures(model, tokenizer, dataset, cfg, device: str, prefix: str, funcs: dict) -> dict:
    """``pass_rate`` (the share of prompts whose greedy completion :func:`~onegpu.training.objectives.rewards.
    correctness` scores 1), ``reward`` (the mean weighted sum of ``funcs``' scores, unscorable ones left out),
    ``completions/mean_length`` (tokens), ``prompts`` and ``runtime`` (s), each under ``prefix``; in batches of
    ``evaluate.per_device_eval_batch_size`` prompts, ``train.grpo.max_completion_length`` tokens at most.

    Args:
        dataset: a prepared prompt-answer split (``prompt``, ``answer``, ``prompt_ids``).
        funcs: name -> reward function (``train.grpo.reward_funcs``, resolved).
    """
    g, size = cfg.train.grpo, cfg.evaluate.per_device_eval_batch_size
    weights = g.reward_weights or [1.0] * len(funcs)
    model.to(device)
    start, passed, total, scored, tokens = time.perf_counter(), 0.0, 0.0, 0, 0
    eos = generation.eos_ids(tokenizer, model)
    for i in range(0, len(dataset), size):
        part = dataset[i:i + size]
        gens = greedy(model, part["prompt_ids"], g.max_completion_length, tokenizer.pad_token_id, eos)
        texts = [tokenizer.decode(ids[:n], skip_special_tokens=True)
                 for ids, n in zip(gens.completion_ids.tolist(), gens.lengths.tolist())]
        passed += sum(rewards.correctness(part["prompt"], texts, part["answer"]))
        scores = rewards.score(funcs, part["prompt"], texts, {"answer": part["answer"]})
        for row in zip(*scores.values()):
            if any(s is not None for s in row):
                total += sum(w * s for w, s in zip(weights, row) if s is not None)
                scored += 1
        tokens += int(gens.lengths.sum())
    n = len(dataset)
    out = {"pass_rate": passed / n, "reward": total / scored if scored else float("nan"),
           "completions/mean_length": tokens / n, "prompts": n, "runtime": time.perf_counter() - start}
    return {f"{prefix}_{k}": v for k, v in out.items()}
