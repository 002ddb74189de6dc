"""``onegpu estimate``: predicted memory per micro-batch for the current params, without training.

One probe forward pass on one and two copies of the longest training row (with and without activation
checkpointing; the training's autocast, attention kernel and LoRA adapters) fixes the activation line; params,
grads, optimizer states: exact sums over the model (:mod:`onegpu.training.memory.autobatch`; one rank's under
train.fsdp, ``sharding.per_rank_estimate``). Rows: data/processed, else a few hundred from the source."""
from __future__ import annotations

import time

from datasets import load_from_disk
from datasets.utils.logging import disable_progress_bar

from onegpu import config, data, paths
from onegpu.data import pipeline
from onegpu.formatting import GiB
from onegpu.measure import memory
from onegpu.models import loader
from onegpu.training import objectives, validation
from onegpu.training.memory import autobatch, checkpointing
from onegpu.training.parallel import sharding
from onegpu.training.session import build_model, check_flattened

DEFAULT_MICRO_BATCHES = [1, 2, 4, 8, 16, 32, 64]
SAMPLE_ROWS = 256  # rows read from data.source when prepare has not run


def _rows(cfg: config.Config, tokenizer_path: str | None):
    """Rows for ``onegpu estimate``: ``(DatasetDict, tokenizer, where they came from)``: data/processed
    when prepare has run, else prepare's own reading of the first :data:`SAMPLE_ROWS` kept rows of
    ``data.source`` (:func:`onegpu.data.pipeline.sample`: its reader, de-duplication and tokenization, a
    byte-level BPE trained on them for a model built from config)."""
    if paths.PROCESSED.is_dir():
        tok_path = str(paths.TOKENIZER) if tokenizer_path is None else tokenizer_path
        return load_from_disk(str(paths.PROCESSED)), loader.load_tokenizer(tok_path, cfg.model.task), "data/processed"
    fmt = data.check_input(cfg)
    dsd, tokenizer = pipeline.sample(cfg, fmt, pipeline.tokenizer_maker(cfg), SAMPLE_ROWS)
    return dsd, tokenizer, f"{cfg.data.source} (first {len(dsd['train'])} rows, {fmt}, as prepare makes them)"


def run(cfg: config.Config, micro_batches: list[int] | None = None, budget_gib: float | None = None) -> dict:
    config.check_device(cfg, memory.device_facts())  # e.g. flash_attention_2 on a CPU: one line, before any work
    disable_progress_bar()
    start = time.perf_counter()
    task = cfg.model.task
    path = loader.resolve_model_path(cfg.model.name_or_path)
    dsd, tokenizer, where = _rows(cfg, path)
    check_flattened(cfg, path)  # padding-free / packing on a model that cannot keep sequences apart
    # as the train stage builds it: the attention kernel (eager saves the attention probabilities, SDPA
    # does not) and LoRA (grads and optimizer states then exist for the adapters only)
    model, _ = build_model(cfg, path, {"labels": dsd["train"].features["label"].names}, tokenizer)
    loader.no_kv_cache(model)  # as training runs it
    parts = objectives.training_parts(dsd, cfg, tokenizer, with_length=True)
    est = autobatch.estimate(model, parts.rows, parts.collator, parts.loss,
                             micro_batches or DEFAULT_MICRO_BATCHES, cfg.train.optim,
                             cfg.train.gradient_checkpointing,
                             lambda m: checkpointing.enable(m, cfg.train),
                             mixed_precision=cfg.train.mixed_precision)
    if cfg.train.fsdp.enabled:  # one rank's share of the states, plus the weights gathered at once
        est = sharding.per_rank_estimate(model, est, cfg.train)
    budget_gib = budget_gib if budget_gib is not None else cfg.train.memory_budget_gib
    budget = int(budget_gib * GiB) if budget_gib else None
    precision = "fp32" if cfg.train.mixed_precision == "no" else f"{cfg.train.mixed_precision} autocast"
    lora_note = "" if cfg.model.lora_adapters is None else f", LoRA r={cfg.model.lora.r}"
    if objectives.get(task).causal_lm:
        lora_note += ", LM head " + ("fused (targets only, in tiles)" if cfg.train.fused_lm_head else "whole logits")
    print(f"memory estimate for {type(model).__name__}, precision {precision}, attention "
          f"{loader.attention_kernel(model)}, optimizer {cfg.train.optim}{lora_note}, rows from {where}:")
    print(autobatch.format_estimate(est, budget, cfg.train.gradient_checkpointing))
    for line in filter(None, (validation.estimate_line(model, tokenizer, dsd, cfg, est),
                              objectives.get(task).estimate_line(model))):  # a pass; a reference model
        print(line)
    if cfg.train.activation_offloading:
        print(autobatch.offloading_line(est, cfg.train.gradient_checkpointing))
    print(f"({time.perf_counter() - start:.1f} s; CUDA adds its context and allocator slack, the CPU process "
          "its libraries: compare with mem_activation_bytes, not peak RSS)")
    if cfg.train.num_processes > 1:
        print(f"(per process: each of the {cfg.train.num_processes} processes of train.num_processes needs this on "
              f"its own device; effective batch = micro-batch x accumulation x {cfg.train.num_processes})")
    return est
