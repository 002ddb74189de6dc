"""Reading instruction data: the packaged ``bbcnews-headlines`` and prompt-completion or ``messages`` tables.

``bbcnews-headlines`` is the packaged BBC corpus (:func:`onegpu.data.sources.bbcnews_dir`) as
prompt-completion rows: each file's first line is its headline (the completion); the prompt is
:data:`HEADLINE_INSTRUCTION` followed by the article body (the rest of the file), which tokenization
truncates to fit ``data.max_length`` (:mod:`onegpu.data.chat`); the topic folder is the row's label, so
the splits stay stratified by topic.

A table (.jsonl, .csv, .parquet) holds ``prompt`` + ``completion`` or ``messages`` columns
(:func:`onegpu.data.formats.detect`); a CSV cell of messages is JSON text. Its label column
(``data.label_column``) stratifies the splits when present. Rows are de-duplicated and counted per reason
(:data:`onegpu.data.formats.SFT_DROP_REASONS`), as text rows are.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from onegpu.config import PACKAGED_HEADLINES, DataConfig
from onegpu.data import formats
from onegpu.data.splits import drop_rows
from onegpu.data.sources import _check_file, _decode, _decode_utf8, _jsonl_records, _parquet_records, bbcnews_dir
from onegpu.errors import DataError

HEADLINE_INSTRUCTION = "Write the headline of this BBC News article.\n\n"
NO_LABEL = "text"  # the label of every row when the data has none (as causal LM text data)


@dataclass
class SftData:
    """Instruction rows as read: ``rows`` hold ``prompt`` and ``completion`` (a string, or a list of messages)
    or ``messages``; ``labels`` a string per row (for stratified splits)."""
    format: str
    rows: list[dict]
    labels: list[str]
    source: str
    undecodable: int = 0


def read_headlines() -> SftData:
    """The packaged corpus as prompt (instruction + body) -> completion (headline) rows, labelled by topic."""
    root, rows, labels, bad = bbcnews_dir(), [], [], 0
    for f in sorted(root.glob("*/*.txt")):
        text, ok = _decode(f.read_bytes())
        bad += not ok
        head, _, body = text.strip().partition("\n")
        rows.append({"prompt": HEADLINE_INSTRUCTION + body.strip() if body.strip() else "",
                     "completion": head.strip()})
        labels.append(f.parent.name)
    return SftData(formats.PROMPT_COMPLETION, rows, labels, root.resolve().as_uri(), bad)


def _records(path: str) -> tuple[list[tuple[int, dict]], dict, str]:
    """Rows of a .jsonl, .parquet or .csv file as ``(number, dict)``, its columns, and the unit rows are
    numbered in ("line" or "row")."""
    p = Path(path).expanduser()
    _check_file(path)
    if p.stat().st_size == 0:
        raise DataError(f"data.source={path!r}: the file is empty")
    if p.suffix.lower() == ".parquet":
        return (*_parquet_records(path), "row")
    text = _decode_utf8(p.read_bytes(), path)
    if p.suffix.lower() == ".jsonl":
        return (*_jsonl_records(text, path), "line")
    import csv
    import io
    reader = csv.DictReader(io.StringIO(text))
    return list(enumerate(reader, 1)), dict.fromkeys(reader.fieldnames or []), "row"


def _cell(value, fmt_key: str, where: str, source: str):
    """A prompt/completion cell: a string (stripped) or a conversational list of messages."""
    if value is None:
        return ""
    if formats.is_conversational(value) or isinstance(value, list):
        return formats.messages_cell(value, where, source, fmt_key)
    if not isinstance(value, str):
        raise DataError(f"data.source={source!r}: {where}: the {fmt_key} cell is a {type(value).__name__}; it must "
                        "be a string or a list of {role, content} messages")
    return value.strip()


def read_table(cfg: DataConfig) -> SftData:
    """Prompt-completion or messages rows of ``data.source``.

    Raises:
        DataError: as :func:`onegpu.data.sources.read_table` for the file; a messages cell that is not a
            list of role/content, or without an assistant turn under ``data.assistant_only_loss``
            (the message names the row); no prompt-completion or messages columns.
    """
    records, columns, unit = _records(cfg.source)
    fmt = formats.detect(columns)
    if fmt == formats.TEXT:
        raise DataError(f"data.source={cfg.source!r} has neither prompt + completion nor messages columns "
                        f"(columns: {', '.join(map(str, columns))})")
    rows, csv_text = [], Path(cfg.source).suffix.lower() == ".csv"
    for n, r in records:
        where = f"{unit} {n}"
        if fmt == formats.MESSAGES:
            msgs = formats.messages_cell(r.get("messages"), where, cfg.source, csv_text=csv_text) \
                if r.get("messages") else []
            if msgs:
                formats.check_roles(msgs, where, cfg.source, cfg.assistant_only_loss)
            rows.append({"messages": msgs})
        else:
            rows.append({k: _cell(r.get(k), k, where, cfg.source) for k in ("prompt", "completion")})
    labels = [str(r.get(cfg.label_column) or NO_LABEL).strip() for _, r in records] if cfg.label_column in columns \
        else [NO_LABEL] * len(records)
    if not rows:
        raise DataError(f"data.source={cfg.source!r}: the file has a header but no rows")
    return SftData(fmt, rows, labels, Path(cfg.source).expanduser().resolve().as_uri())


def read(cfg: DataConfig) -> SftData:
    """The instruction rows of ``data.source`` (packaged headlines or a table)."""
    return read_headlines() if cfg.source == PACKAGED_HEADLINES else read_table(cfg)


def key(row: dict) -> str:
    """The row as one string (sorted-key JSON): its identity for de-duplication and the data fingerprint."""
    return json.dumps(row, ensure_ascii=False, sort_keys=True)


def deduplicate(data: SftData) -> tuple[list[dict], list[str], dict[str, int]]:
    """Drop rows with an empty prompt, an empty completion (no messages), then exact repeats (the first kept).

    Returns:
        rows, labels kept (source order), and ``{reason: rows}`` for every reason of the format in
        :data:`onegpu.data.formats.SFT_DROP_REASONS` (zeros included; ``completion_too_long`` and
        ``no_target_after_truncation`` are counted later, by tokenization).
    """
    def empty(row: dict, _label) -> str | None:
        if data.format == formats.MESSAGES:
            return "empty_messages" if not row["messages"] else None
        return "empty_prompt" if not row["prompt"] else "empty_completion" if not row["completion"] else None
    return drop_rows(data.rows, data.labels, formats.SFT_DROP_REASONS[data.format], key, empty)
