"""What the instruction formats' readers share (:mod:`onegpu.data.prompt_completion`,
:mod:`onegpu.data.messages`, :mod:`onegpu.data.preference`): reading a table (.jsonl, .csv, .parquet) row by
row into the format's columns, the row's identity, tokenization with the loss masks (:mod:`onegpu.data.chat`).

A table's label column (``data.label_column``) stratifies the splits when present; without one every row
has the label ``text``. Rows are de-duplicated and counted per reason
(:data:`onegpu.data.formats.DROP_REASONS`), as text rows are.
"""
from __future__ import annotations

import json
from pathlib import Path

from onegpu.config import Config
from onegpu.data import files, tokens
from onegpu.data.base import Reader, Rows
from onegpu.data.text import NO_LABEL
from onegpu.errors import DataError


class InstructionReader(Reader):
    """An instruction format's reader; a subclass gives :meth:`cells` (one record's cells of its columns).
    ``required``: the columns a table must have (empty: all of :attr:`columns`)."""
    required: tuple[str, ...] = ()

    def cells(self, record: dict, where: str, cfg: Config, csv_text: bool) -> dict:
        """``{column: cell}`` of one table record, checked (``where`` is ``"line 3"`` or ``"row 3"``;
        ``csv_text``: the cells are a CSV's text). Raises DataError naming ``where``."""
        raise NotImplementedError

    def read_table(self, cfg: Config) -> Rows:
        """The format's rows of the table ``data.source``.

        Raises:
            DataError: as :func:`onegpu.data.files.read_records` for the file; the format's columns missing
                (the message lists the file's); a cell :meth:`cells` refuses; a header but no rows.
        """
        d = cfg.data
        table = files.read_records(d.source, ' such as {"text": ..., "label": ...}')
        if not set(self.required or self.columns) <= set(table.columns):
            raise DataError(f"data.source={d.source!r} has neither prompt + completion, chosen + rejected nor "
                            f"messages columns (columns: {', '.join(map(str, table.columns))})")
        csv_text = Path(d.source).suffix.lower() == ".csv"
        rows = [self.cells(r, f"{table.unit} {n}", cfg, csv_text) for n, r in table.records]
        if d.label_column in table.columns:
            labels = [str(r.get(d.label_column) or NO_LABEL).strip() for _, r in table.records]
        else:
            labels = [NO_LABEL] * len(rows)
        if not rows:
            raise DataError(f"data.source={d.source!r}: the file has a header but no rows")
        source = Path(d.source).expanduser().resolve().as_uri()
        return Rows({c: [r[c] for r in rows] for c in self.columns}, labels, source)

    def key(self, row: dict) -> str:
        """The row's cells as one string (sorted-key JSON of ``{column: cell}``)."""
        return json.dumps({c: row[c] for c in self.columns}, ensure_ascii=False, sort_keys=True)

    def tokenize(self, dsd, tokenizer, cfg: Config):
        """:func:`onegpu.data.tokens.tokenize_instructions`; its drops count under the last of
        :attr:`drop_reasons` (``completion_too_long``, ``no_target_after_truncation``)."""
        dsd, dropped, truncated = tokens.tokenize_instructions(dsd, tokenizer, cfg.data, self.format)
        return dsd, {self.drop_reasons[-1]: dropped}, truncated
