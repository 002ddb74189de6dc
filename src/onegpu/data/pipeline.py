"""Prepare's work on the data, apart from MLflow: read, de-duplicate, split, tokenize, write; and the
estimate's sample, made by the same code. Nothing here knows a data format: the reader of the format
(:mod:`onegpu.data.readers`) does each step."""
from __future__ import annotations

from collections.abc import Callable

from onegpu.config import Config
from onegpu.data import readers, splits
from onegpu.data.base import Reader, Rows
from onegpu.data.describe import stats
from onegpu.errors import DataError


def drop_summary(dropped: dict[str, int]) -> str:
    """``"3 dropped (empty text 1, empty label 1, duplicate 1)"``, or ``"0 dropped"``."""
    parts = [f"{r.replace('_', ' ')} {n}" for r, n in dropped.items() if n]
    return f"{sum(dropped.values())} dropped" + (f" ({', '.join(parts)})" if parts else "")


def _kept(cfg: Config, reader: Reader) -> tuple[Rows, Rows, dict[str, int]]:
    """``(rows read, rows kept, {reason: rows dropped})``. Raises DataError when no row is kept."""
    raw = reader.read(cfg)
    kept, dropped = reader.deduplicate(raw)
    if not len(kept):
        raise DataError(f"data.source={cfg.data.source!r}: no row has {reader.needs(cfg)} ({len(raw)} rows read, "
                        f"{drop_summary(dropped)})")
    return raw, kept, dropped


def prepare(cfg: Config, fmt: str, make_tokenizer: Callable):
    """Read, de-duplicate, split and tokenize ``data.source`` with the reader of ``fmt`` (text rows, or
    instruction rows with their loss masks), without MLflow or writing anything.

    Args:
        fmt: the data's format (:func:`onegpu.data.check.check_input`).
        make_tokenizer: ``train texts -> tokenizer`` (the model's, or one trained on the texts).
    Returns:
        ``(dsd, tokenizer, stats, raw)``: the tokenized ``DatasetDict`` (the format's columns, ``label``,
        the token columns), the tokenizer, the stats (:func:`onegpu.data.describe.stats` plus ``format``
        and ``prompts_truncated``), the :class:`~onegpu.data.base.Rows` read.
    Raises:
        DataError: data that cannot be used (see the readers, the splits and tokenization).
    """
    reader = readers.reader(fmt)
    raw, kept, dropped = _kept(cfg, reader)
    dsd = reader.split(kept, cfg)
    tokenizer = make_tokenizer(reader.texts(dsd["train"]))
    dsd, more, truncated = reader.tokenize(dsd, tokenizer, cfg)
    for reason, n in more.items():
        dropped[reason] += n
    described = stats(dsd, reader.texts, rows_read=len(raw), dropped=dropped, undecodable=raw.undecodable,
                      max_length=cfg.data.max_length)
    described.update(format=fmt, prompts_truncated=truncated)
    return dsd, tokenizer, described, raw


def sample(cfg: Config, fmt: str, make_tokenizer: Callable, n: int):
    """The first ``n`` kept rows of ``data.source`` (read and de-duplicated as :func:`prepare` does, not
    split) tokenized as prepare tokenizes them, as the ``train`` split of a ``DatasetDict`` (``label`` a
    ``ClassLabel`` over every kept row's labels, as in prepare's splits): ``onegpu estimate``'s rows when
    prepare has not run. Returns ``(dsd, tokenizer)``; ``make_tokenizer`` gets the sample's texts.

    Raises:
        DataError: as :func:`prepare` (no row kept; none of the sample fits ``data.max_length``).
    """
    from datasets import DatasetDict
    reader = readers.reader(fmt)
    _, kept, _ = _kept(cfg, reader)
    head = kept.head(n)
    ds = splits.dataset(head.columns, head.labels, sorted(set(kept.labels)))
    tokenizer = make_tokenizer(reader.texts(ds))
    dsd, _, _ = reader.tokenize(DatasetDict(train=ds), tokenizer, cfg)
    return dsd, tokenizer


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
