"""Prepare's work on the data, apart from MLflow: read, de-duplicate, split, tokenize, write."""
from __future__ import annotations

from typing import Callable

from onegpu.config import Config
from onegpu.data import formats, instructions, sources
from onegpu.data.describe import stats
from onegpu.data.splits import deduplicate, split
from onegpu.data.tokens import tokenize, tokenize_instructions
from onegpu.errors import DataError


def drop_summary(dropped: dict[str, int]) -> str:
    """``"3 dropped (empty text 1, empty label 1, duplicate 1)"``, or ``"0 dropped"``."""
    parts = [f"{r.replace('_', ' ')} {n}" for r, n in dropped.items() if n]
    return f"{sum(dropped.values())} dropped" + (f" ({', '.join(parts)})" if parts else "")


def prepare(cfg: Config, fmt: str, make_tokenizer: Callable):
    """Read, de-duplicate, split and tokenize ``data.source`` (text rows, or instruction rows with their
    loss masks), without MLflow or writing anything.

    Args:
        fmt: the data's format (:func:`onegpu.data.check.check_input`).
        make_tokenizer: ``train texts -> tokenizer`` (the model's, or one trained on the texts).
    Returns:
        ``(dsd, tokenizer, stats, raw)``: the tokenized ``DatasetDict``, the tokenizer, the stats
        (:func:`onegpu.data.describe.stats` plus ``format`` and ``prompts_truncated``), what was read.
    Raises:
        DataError: data that cannot be used (see the readers, the splits and tokenization).
    """
    task = cfg.model.task
    sft = fmt != formats.TEXT
    raw = instructions.read(cfg.data) if sft else sources.read(cfg.data, task)
    if sft:
        rows, labels, dropped = instructions.deduplicate(raw)
        texts = [instructions.key(r) for r in rows]
        n_read = len(raw.rows)
    else:
        texts, labels, dropped = deduplicate(raw)
        n_read = len(raw.texts)
    if not texts:
        raise _nothing_left(cfg, fmt, n_read, dropped)
    dsd = split(texts, labels, cfg.data, task)
    tokenizer = make_tokenizer(dsd["train"]["text"])
    truncated = 0
    if sft:
        dsd, too_long, truncated = tokenize_instructions(dsd, tokenizer, cfg.data, fmt)
        dropped[formats.SFT_DROP_REASONS[fmt][-1]] += too_long
    else:
        dsd = tokenize(dsd, tokenizer, cfg.data.max_length, task)
    described = stats(dsd, rows_read=n_read, dropped=dropped, undecodable=raw.undecodable,
                       max_length=cfg.data.max_length)
    described.update(format=fmt, prompts_truncated=truncated)
    return dsd, tokenizer, described, raw


def _nothing_left(cfg: Config, fmt: str, n_read: int, dropped: dict[str, int]) -> DataError:
    """The error for a source none of whose rows is kept, in the columns of its format."""
    d = cfg.data
    needs = {formats.PROMPT_COMPLETION: "a non-blank prompt and a non-blank completion",
             formats.MESSAGES: "a non-empty messages list of role/content turns"}.get(fmt)
    if needs is None:
        needs = (f"a non-blank text in data.text_column={d.text_column!r} and a label in "
                 f"data.label_column={d.label_column!r}")
    return DataError(f"data.source={d.source!r}: no row has {needs} ({n_read} rows read, {drop_summary(dropped)})")


def tokenizer_maker(cfg: Config) -> Callable:
    """The tokenizer maker for :func:`prepare`: the model's, or (causal LM from
    config) a BPE tokenizer trained on the training texts."""
    from onegpu.models import loader
    if cfg.model.name_or_path is None:
        return lambda texts: loader.train_bpe_tokenizer(texts, cfg.model.vocab_size)
    return lambda texts: loader.load_tokenizer(loader.resolve_model_path(cfg.model.name_or_path), cfg.model.task)


def write(dsd, own_tokenizer, stats: dict) -> None:
    """data/processed (with the tokenizer prepare trained, if any) and data/stats.json, each atomically:
    no half-written output for DVC to cache."""
    from onegpu import paths
    with paths.atomic_dir(paths.PROCESSED) as tmp:
        dsd.save_to_disk(str(tmp))
        if own_tokenizer is not None:
            own_tokenizer.save_pretrained(str(tmp / paths.TOKENIZER.name))
    paths.write_json_atomic(paths.STATS, stats)
