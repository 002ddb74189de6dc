"""Tokenization of the split texts (unpadded; padding happens per micro-batch in the collator)."""
from __future__ import annotations

from onegpu.config import token_level
from onegpu.data import formats
from onegpu.errors import DataError

# A tokenizer model_max_length at or above this means "no limit" (transformers uses 1e30 when unset).
NO_LIMIT = 1_000_000


def tokenize(dsd, tokenizer, max_length: int, task: str = "sequence-classification"):
    """Add ``input_ids``/``attention_mask`` (truncated to ``max_length``, unpadded) and ``length``.

    Padding happens per micro-batch in the collator, so a micro-batch is only as long as its longest row.
    For causal LM each text ends with the tokenizer's EOS token (when it has one) before truncation.

    Raises:
        DataError: ``max_length`` is above the tokenizer's ``model_max_length`` (the model's limit).
    """
    check_limit(tokenizer, max_length)
    eos = tokenizer.eos_token if token_level(task) and tokenizer.eos_token else ""

    def fn(batch):
        texts = [t + eos for t in batch["text"]] if eos else batch["text"]
        enc = tokenizer(texts, truncation=True, max_length=max_length)
        enc["length"] = [len(x) for x in enc["input_ids"]]
        return enc
    return dsd.map(fn, batched=True, desc="tokenize")


def tokenize_instructions(dsd, tokenizer, d, fmt: str):
    """Instruction rows (the format's columns, :data:`onegpu.data.formats.COLUMNS`: ``prompt`` and
    ``completion``, or ``messages``) as ``input_ids``, ``attention_mask``, ``labels`` (``IGNORE_INDEX`` where
    the loss is masked), ``length``, ``prompt_length`` (tokens before the completion) and ``reference`` (the
    answer's text), at most ``d.max_length`` (``data.max_length``) tokens each: :mod:`onegpu.data.chat`.
    The format's columns and ``label`` stay.

    Args:
        d: ``data`` params (``max_length``, ``completion_only_loss``, ``assistant_only_loss``).
        fmt: ``prompt-completion`` or ``messages`` (:mod:`onegpu.data.formats`).
    Returns:
        ``(dsd, dropped, truncated)``: rows that could not fit (completion too long, or no target left)
        were dropped, ``dropped`` counts them over all splits; ``truncated`` counts rows whose prompt (or
        conversation) was cut.
    Raises:
        DataError: ``max_length`` above the model's limit; no row of a split fits ``data.max_length``;
            a row the tokenizer cannot render (:mod:`onegpu.data.chat`).
    """
    from onegpu.data import chat
    check_limit(tokenizer, d.max_length)
    only = chat.completion_only(d.completion_only_loss, fmt)
    columns = formats.COLUMNS[fmt]

    def fn(ex):
        row = {c: ex[c] for c in columns}
        out = chat.tokenize_row(tokenizer, row, d.max_length, only, d.assistant_only_loss)
        if out is None:
            return {"input_ids": [], "attention_mask": [], "labels": [], "prompt_length": 0, "truncated": False,
                    "length": 0, "reference": "", "kept": False}
        return {**out, "attention_mask": [1] * len(out["input_ids"]), "length": len(out["input_ids"]),
                "reference": chat.reference(row), "kept": True}
    return kept_rows(dsd.map(fn, desc="tokenize"), f"row fits data.max_length={d.max_length} tokens with its whole "
                     "answer (the prompt is cut, never the answer); raise data.max_length")


def kept_rows(dsd, fits: str):
    """``dsd`` without the rows tokenization marked ``kept: False`` (its ``kept`` and ``truncated`` columns
    dropped): ``(dsd, rows dropped, rows truncated)`` over all splits.

    Raises:
        DataError: a split left empty: ``no <split> <fits>``.
    """
    dropped = sum(not k for s in dsd for k in dsd[s]["kept"])
    truncated = sum(sum(dsd[s]["truncated"]) for s in dsd)
    dsd = dsd.filter(lambda kept: kept, input_columns="kept").remove_columns(["kept", "truncated"])
    for s in dsd:
        if len(dsd[s]) == 0:
            raise DataError(f"no {s} {fits}")
    return dsd, dropped, truncated


def check_limit(tokenizer, max_length: int) -> None:
    """Raises DataError when ``max_length`` (``data.max_length``) is above the tokenizer's ``model_max_length``."""
    limit = getattr(tokenizer, "model_max_length", None)
    if isinstance(limit, int) and limit < NO_LIMIT and max_length > limit:
        raise DataError(f"data.max_length={max_length} is longer than the model's limit of {limit} tokens "
                        f"(its tokenizer's model_max_length): longer rows would overflow its position "
                        f"embeddings; set data.max_length to at most {limit}")
