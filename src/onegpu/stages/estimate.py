"""``onegpu estimate``: predicted memory per micro-batch for the current params, without training.

One probe forward pass on one and two copies of the longest training row (with and without
activation checkpointing; under the bf16/fp16 autocast the training uses, with the configured attention
kernel and LoRA adapters) fixes the activation line; params, grads and optimizer states are exact
sums over the model (:mod:`onegpu.autobatch`). Uses data/processed when prepare has run, otherwise a
few hundred rows read straight from the source.
"""
from __future__ import annotations

import time

from onegpu import autobatch, data, models, paths
from onegpu.training import checkpointing
from onegpu.config import Config

DEFAULT_MICRO_BATCHES = [1, 2, 4, 8, 16, 32, 64]


def _rows(cfg: Config, tokenizer_path):
    from datasets import DatasetDict, load_from_disk
    task = cfg.model.task
    if paths.PROCESSED.is_dir():
        dsd = load_from_disk(str(paths.PROCESSED))
        tok_path = str(paths.TOKENIZER) if tokenizer_path is None else tokenizer_path
        return dsd, models.load_tokenizer(tok_path, task), "data/processed"
    fmt = data.check_input(cfg)
    if fmt != "text":  # instruction data: prepare's rows with their masks and truncation (nothing written)
        from onegpu.data import pipeline
        dsd, tokenizer, _, _ = pipeline.prepare(cfg, fmt, lambda texts: models.load_tokenizer(tokenizer_path, task))
        return dsd, tokenizer, f"{cfg.data.source} ({fmt}, as prepare would write it)"
    raw = data.read(cfg.data, task)
    texts, labels, _ = data.deduplicate(raw)
    from datasets import ClassLabel, Dataset
    names = sorted(set(labels))
    ds = Dataset.from_dict({"text": texts[:256], "label": labels[:256]}).cast_column("label", ClassLabel(names=names))
    if tokenizer_path is None:
        tokenizer = models.train_bpe_tokenizer(texts[:256], cfg.model.vocab_size)
    else:
        tokenizer = models.load_tokenizer(tokenizer_path, task)
    dsd = data.tokenize(DatasetDict(train=ds), tokenizer, cfg.data.max_length, task)
    return dsd, tokenizer, f"{cfg.data.source} (first {len(ds)} rows)"


def _attention(model) -> str:
    """The attention kernel the built model uses (``config._attn_implementation``: ``eager``, ``sdpa``,
    ...), which ``model.attn_implementation: null`` leaves to transformers."""
    return str(getattr(getattr(model, "config", None), "_attn_implementation", None) or "the model's default")


def run(cfg: Config, micro_batches: list[int] | None = None, budget_gib: float | None = None) -> dict:
    from datasets.utils.logging import disable_progress_bar

    from onegpu.training.batches import train_collator, training_rows
    from onegpu.training.loss import loss_for
    disable_progress_bar()
    start = time.perf_counter()
    task = cfg.model.task
    path = models.resolve_model_path(cfg.model.name_or_path)
    dsd, tokenizer, where = _rows(cfg, path)
    labels = dsd["train"].features["label"].names
    from onegpu import measure
    from onegpu.training.session import check_flattened, check_kernels
    check_kernels(cfg, measure.cuda_available())  # flash_attention_2 / adamw_bnb_8bit: one line, not a traceback
    check_flattened(cfg)  # padding-free / packing on a model that cannot keep sequences apart
    attn = cfg.model.attn_implementation  # eager saves the attention probabilities; SDPA does not
    if task == "causal-lm":
        model = models.build_causal_lm(path, tokenizer, cfg.model, cfg.data.max_length, cfg.model.dropout, attn)
    else:
        model = models.build_classifier(path, labels, cfg.model.dropout, attn)
    if cfg.model.lora_adapters is not None:  # grads and optimizer states then exist for the adapters only
        from onegpu import lora
        model = lora.apply(model, cfg.model.lora_adapters, task, cfg.train.gradient_checkpointing)
    if getattr(getattr(model, "config", None), "use_cache", None):  # as training runs it (a KV cache hides packed sequences)
        model.config.use_cache = False
    rows = training_rows(dsd, task, cfg)
    est = autobatch.estimate(model, rows, train_collator(cfg, tokenizer), loss_for(task),
                             micro_batches or DEFAULT_MICRO_BATCHES, cfg.train.optim,
                             cfg.train.gradient_checkpointing,
                             lambda m: checkpointing.enable(m, cfg.train),
                             mixed_precision=cfg.train.mixed_precision)
    budget_gib = budget_gib if budget_gib is not None else cfg.train.memory_budget_gib
    budget = int(budget_gib * 2**30) if budget_gib else None
    precision = "fp32" if cfg.train.mixed_precision == "no" else f"{cfg.train.mixed_precision} autocast"
    lora_note = "" if cfg.model.lora_adapters is None else f", LoRA r={cfg.model.lora.r}"
    print(f"memory estimate for {type(model).__name__}, precision {precision}, attention "
          f"{_attention(model)}, optimizer {cfg.train.optim}{lora_note}, rows from {where}:")
    print(autobatch.format_estimate(est, budget, cfg.train.gradient_checkpointing))
    print(f"({time.perf_counter() - start:.1f} s; CUDA adds its context and allocator slack, the CPU process "
          "its libraries: compare with mem_activation_bytes, not peak RSS)")
    if cfg.train.num_processes > 1:
        print(f"(per process: each of the {cfg.train.num_processes} processes of train.num_processes needs this on "
              f"its own device; effective batch = micro-batch x accumulation x {cfg.train.num_processes})")
    return est
