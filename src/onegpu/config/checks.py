"""Validation: each key's rule (declared with the key), each section's combinations, then the ones across
sections (SFT's, DPO's, FSDP2's, validation's): :func:`validate`."""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from onegpu.config.data import PACKAGED_DATA, PACKAGED_HEADLINES, PACKAGED_PAIRS, check_data
from onegpu.config.grpo import check_grpo
from onegpu.config.knobs import fail
from onegpu.config.layout import flatten
from onegpu.config.model import TASK_TRAITS, causal_lm, check_model, token_level
from onegpu.config.schema import RULES, SECTIONS, SUBSECTIONS, Config
from onegpu.config.train import check_train

# section -> the checks of its keys together (after each key's own rule).
COMBINATIONS: dict[str, Callable[[Any, str], None]] = {"data": check_data, "model": check_model,
                                                      "train": check_train}


def _check_sft(cfg: Config, source: str) -> None:
    """The instruction-data keys against the task: padding-free batches exist for a causal LM only; packing
    and the answer-only losses for causal-lm only (a classifier has one label per row, a preference pair
    two whole answers); the packaged sources for their task (:func:`_check_dpo`: DPO's own keys)."""
    d, task = cfg.data, cfg.model.task
    keys = (("padding_free", d.padding_free),) if not causal_lm(task) else ()
    if not token_level(task):
        keys += (("packing", d.packing), ("completion_only_loss", d.completion_only_loss),
                 ("assistant_only_loss", d.assistant_only_loss))
    for key, on in keys:
        if on:
            fail(source, f"data.{key}", f"is {on!r}, but model.task is {task}: it applies to "
                  f"causal-lm{' and preference' if key == 'padding_free' else ''} only (set data.{key} back to its "
                  "default)")
    wanted = {PACKAGED_DATA: "sequence-classification", PACKAGED_HEADLINES: "causal-lm", PACKAGED_PAIRS: "preference"}
    if d.source in wanted and wanted[d.source] != task and not (d.source == PACKAGED_DATA and token_level(task)):
        what = {PACKAGED_HEADLINES: "instruction data (prompt = article, completion = headline)",
                PACKAGED_PAIRS: "preference pairs (chosen = the article's headline, rejected = another's)",
                PACKAGED_DATA: "labelled text"}[d.source]
        fail(source, "data.source", f"'{d.source}' is {what} for model.task: {wanted[d.source]}, but model.task "
              f"is {task}")


def _check_dpo(cfg: Config, source: str) -> None:
    """``train.dpo`` against itself and the model: one weight per loss type; no dropout asked for where the
    policy's is switched off."""
    d = cfg.train.dpo
    if cfg.model.task == "preference" and d.disable_dropout and cfg.model.dropout:
        fail(source, "model.dropout", f"is {cfg.model.dropout}, but train.dpo.disable_dropout is true (every dropout "
              "of the policy off); set one of them back")
    if d.loss_weights is not None and len(d.loss_weights) != len(d.loss_type):
        fail(source, "train.dpo.loss_weights", f"has {len(d.loss_weights)} weights for {len(d.loss_type)} loss "
              f"types ({', '.join(d.loss_type)}); give one per loss type or null")


# train.fsdp.enabled with another key: (the other key, it is set, why not yet, what to set): one line each, in order.
_FSDP_REFUSALS: tuple[tuple[str, Callable[[Config], bool], str], ...] = (
    ("train.backend", lambda c: c.train.backend == "trainer",
     "the trainer backend would shard through accelerate's FSDP plugin, which engages on GPUs only (on a CPU it "
     "runs plain data parallel) and is not proven here; set train.backend: accelerate"),
    ("train.num_processes", lambda c: c.train.num_processes < 2,
     "one process has nothing to shard (FSDP2 splits the weights over the processes); set train.num_processes to 2 "
     "or more, or train.fsdp.enabled: false"),
    ("train.oom_retry", lambda c: c.train.oom_retry,
     "a retry re-splits one process's micro-batches, and every sharded forward gathers weights with all processes; "
     "set train.oom_retry: false"),
    ("train.torch_compile", lambda c: c.train.torch_compile, "torch.compile of a sharded model is not proven yet; "
     "set train.torch_compile: false"),
    ("train.fp16", lambda c: c.train.fp16, "fp16's gradient scaler over sharded gradients is not proven yet; use bf16 "
     "or neither"),
)


def _check_fsdp(cfg: Config, source: str) -> None:
    """``train.fsdp.enabled`` with what this first slice of FSDP2 does not run (:data:`_FSDP_REFUSALS`)."""
    if cfg.train.fsdp.enabled:
        for key, bad, problem in _FSDP_REFUSALS:
            if bad(cfg):
                fail(source, "train.fsdp.enabled", f"is true with {key}: {problem}")


# The validation figures of each task (onegpu.training.objectives.heldout): what train.metric_for_best_model may name.
TASK_EVAL_METRICS = {task: traits.eval_metrics for task, traits in TASK_TRAITS.items()}


def _check_validation(cfg: Config, source: str) -> None:
    """The best-model and early-stopping keys need validation points, and a figure the task has."""
    t = cfg.train
    for key, on in (("load_best_model_at_end", t.load_best_model_at_end),
                    ("early_stopping_patience", t.early_stopping_patience is not None)):
        if on and t.eval_strategy == "no":
            fail(source, f"train.{key}", "needs validation points; set train.eval_strategy: steps (or epoch)")
    allowed = TASK_EVAL_METRICS[cfg.model.task]
    used = t.load_best_model_at_end or t.early_stopping_patience is not None
    # (the default, eval_loss, stands unused for a task without it: GRPO's validation is a pass rate)
    if t.metric_for_best_model not in allowed and (used or t.metric_for_best_model != "eval_loss"):
        fail(source, "train.metric_for_best_model", f"{t.metric_for_best_model} is not a figure of "
              f"{cfg.model.task}; use one of {', '.join(allowed)}")


def validate(cfg: Config, source: str = "params") -> None:
    """Check ranges and combinations that types alone cannot: every value finite, then per section
    (in schema order) each key's :data:`RULES` entry and the section's :data:`COMBINATIONS` check.

    Raises:
        ConfigError: naming the first offending key, what is allowed and the value given.
    """
    for key, value in flatten(cfg.to_dict()).items():
        if isinstance(value, float) and not math.isfinite(value):
            fail(source, key, f"must be finite (a number), got {value}")
    for section in SECTIONS:
        values = getattr(cfg, section)
        for name, value in asdict(values).items():
            allowed, problem = RULES.get(f"{section}.{name}", (None, ""))
            if allowed is not None and not allowed(value):
                fail(source, f"{section}.{name}", problem.format(v=value))
        for sub in SUBSECTIONS:  # a mapping's keys, before its section's combinations
            value = getattr(values, sub.partition(".")[2]) if sub.startswith(section + ".") else None
            for name, v in (asdict(value).items() if value is not None else ()):
                allowed, problem = RULES.get(f"{sub}.{name}", (None, ""))
                if allowed is not None and not allowed(v):
                    fail(source, f"{sub}.{name}", problem.format(v=v))
        if section in COMBINATIONS:
            COMBINATIONS[section](values, source)
    _check_sft(cfg, source)
    _check_dpo(cfg, source)
    check_grpo(cfg, source)
    _check_validation(cfg, source)
    _check_fsdp(cfg, source)
