"""Text data (:data:`onegpu.data.formats.TEXT`): one ``text`` and one string label per row.

Sources: the packaged ``bbcnews`` corpus (:func:`onegpu.data.files.bbcnews_dir`) and a user's
``<label>/*.txt`` directory (one example per file, the folder its label); a ``.csv``, ``.jsonl`` or
``.parquet`` file with a text and a label column (``data.text_column``, ``data.label_column``), every cell
read as the string the file holds: no type inference (a CSV label ``1`` stays ``"1"``, never ``1.0``; a JSON
number, boolean or null is spelled as JSON spells it) and no NA guessing (``NA`` and ``None`` are texts;
only an empty cell or JSON null is empty). Texts and labels are stripped of surrounding whitespace; a
causal LM needs no label column (every row then has the label ``text``).

Rows are dropped only for a reason, each counted (:data:`onegpu.data.formats.DROP_REASONS`): an empty text
(blank or whitespace only), an empty label, or an exact repeat of an earlier text.
"""
from __future__ import annotations

import json
from pathlib import Path

from onegpu.config import Config, DataConfig, token_level
from onegpu.data import files, formats, tokens
from onegpu.data.base import Reader, Rows
from onegpu.errors import DataError

NO_LABEL = "text"  # the label of every row of causal-LM data without a label column


def read_text_tree(root: Path) -> Rows:
    """``root/<label>/*.txt``: one row per file (its text stripped), the folder name as its label.

    Files that are not valid UTF-8 are decoded as cp1252 and counted in ``undecodable``; empty files are
    read as empty texts (dropped and counted later).
    Raises:
        DataError: no ``<label>/*.txt`` file under ``root``.
    """
    found, bad = files.text_files(root)
    return Rows({"text": [t.strip() for _, t in found]}, [lab for lab, _ in found], root.resolve().as_uri(), bad)


def _cell(value, key: str, column: str, where: str) -> str:
    """A field as the label/text string the user wrote: strings as they are, numbers and booleans as JSON
    spells them (``7``, ``1.5``, ``true``), null or missing as ``""`` (an empty cell).

    Raises:
        DataError: a JSON list or object (``where`` names its line or row).
    """
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, (bool, int, float)):
        return json.dumps(value)
    raise DataError(f"{key}={column!r}: {where} holds a JSON {type(value).__name__}; a text or label must be "
                    "a string, a number, a boolean or null")


def read_table(d: DataConfig, label_required: bool = True) -> Rows:
    """The text and label columns of the ``.csv``/``.jsonl``/``.parquet`` file ``data.source``.

    Returns:
        Rows with one entry per data row of the file (blank lines are not rows).
    Raises:
        DataError: the file is missing, a directory, empty, not UTF-8, unparsable, lacks one of the columns,
            holds a list or object in one, or has a header but no rows.
    """
    path, text_column, label_column = d.source, d.text_column, d.label_column
    table = files.read_records(path, ' such as {"' + text_column + '": ..., "' + label_column + '": ...}')
    records, columns = table.records, dict(table.columns)
    if not label_required and label_column not in columns:
        records = [(n, {**r, label_column: NO_LABEL}) for n, r in records]
        columns[label_column] = None
    csv = Path(path).suffix.lower() == ".csv"
    for key, col in (("data.text_column", text_column), ("data.label_column", label_column)):
        if col in columns:
            continue
        if csv:
            raise DataError(f"{key}={col!r} is not a column of {path} (columns: {', '.join(map(str, columns))})")
        raise DataError(f"{key}={col!r} is not a field of any line of {path} (fields: {', '.join(columns)})")
    texts = [_cell(r.get(text_column), "data.text_column", text_column, f"{table.unit} {n}") for n, r in records]
    labels = [_cell(r.get(label_column), "data.label_column", label_column, f"{table.unit} {n}")
              for n, r in records]
    if not texts:
        raise DataError(f"data.source={path!r}: the file has a header but no rows")
    source = Path(path).expanduser().resolve().as_uri()
    return Rows({"text": [t.strip() for t in texts]}, [lab.strip() for lab in labels], source)


class TextReader(Reader):
    """Text and label rows, tokenized whole (:func:`onegpu.data.tokens.tokenize`)."""
    format = formats.TEXT
    columns = formats.COLUMNS[formats.TEXT]
    drop_reasons = formats.DROP_REASONS[formats.TEXT]

    def read(self, cfg: Config) -> Rows:
        d = cfg.data
        kind = files.source_kind(d.source)
        if kind == "package":
            return read_text_tree(files.bbcnews_dir())
        if kind == "directory":
            return read_text_tree(Path(d.source).expanduser())
        return read_table(d, label_required=not token_level(cfg.model.task))

    def empty(self, row: dict, label: str) -> str | None:
        return "empty_text" if not row["text"] else "empty_label" if not label else None

    def key(self, row: dict) -> str:
        return row["text"]

    def needs(self, cfg: Config) -> str:
        return (f"a non-blank text in data.text_column={cfg.data.text_column!r} and a label in "
                f"data.label_column={cfg.data.label_column!r}")

    def texts(self, ds) -> list[str]:
        return list(ds["text"])

    def tokenize(self, dsd, tokenizer, cfg: Config):
        return tokens.tokenize(dsd, tokenizer, cfg.data.max_length, cfg.model.task), {}, 0


READER = TextReader()
