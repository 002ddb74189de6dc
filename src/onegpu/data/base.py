"""The one interface every data format's reader has: read, de-duplicate, split, tokenize.

A reader (:mod:`onegpu.data.text`, :mod:`onegpu.data.prompt_completion`, :mod:`onegpu.data.messages`; the
registry is :mod:`onegpu.data.readers`) reads ``data.source`` into :class:`Rows`, whose data columns are the
format's own (``text``; ``prompt`` + ``completion``; ``messages``), and keeps them as columns through the
splits and tokenization. Prepare (:func:`onegpu.data.pipeline.prepare`) and the estimate's sample
(:func:`onegpu.data.pipeline.sample`) call only the methods here.
"""
from __future__ import annotations

from dataclasses import dataclass

from onegpu.config import Config
from onegpu.data import splits


@dataclass
class Rows:
    """Rows as read (before de-duplication) or kept: ``columns`` maps each of the format's data columns to
    its cells (one per row, all of one length), ``labels`` one string per row (stratifies the splits)."""
    columns: dict[str, list]
    labels: list[str]
    source: str               # a path or URI, for the MLflow dataset input
    undecodable: int = 0      # files that were not valid UTF-8 (decoded as cp1252 instead)

    def __len__(self) -> int:
        return len(self.labels)

    def records(self) -> list[dict]:
        """One ``{column: cell}`` per row, in order."""
        return [dict(zip(self.columns, cells)) for cells in zip(*self.columns.values())]

    def kept(self, records: list[dict], labels: list[str]) -> Rows:
        """These rows' source and counts with only ``records`` (dicts of the same columns) and ``labels``."""
        return Rows({c: [r[c] for r in records] for c in self.columns}, labels, self.source, self.undecodable)

    def head(self, n: int) -> Rows:
        """The first ``n`` rows."""
        return Rows({c: v[:n] for c, v in self.columns.items()}, self.labels[:n], self.source, self.undecodable)


class Reader:
    """One data format. Subclasses set :attr:`format`, :attr:`columns` and :attr:`drop_reasons` and give
    :meth:`read`, :meth:`empty`, :meth:`tokenize` and :meth:`needs`; :meth:`key` is the row's identity."""
    format: str = ""
    columns: tuple[str, ...] = ()
    drop_reasons: tuple[str, ...] = ()  # every reason a row is dropped, in the order they are tested

    def read(self, cfg: Config) -> Rows:
        """Every row of ``data.source``, before de-duplication. Raises DataError for a file it cannot use."""
        raise NotImplementedError

    def empty(self, row: dict, label: str) -> str | None:
        """The reason (one of :attr:`drop_reasons`) a row is empty, or None."""
        raise NotImplementedError

    def key(self, row: dict) -> str:
        """The row's identity as one string: exact repeats are dropped by it and the data fingerprint hashes it."""
        raise NotImplementedError

    def needs(self, cfg: Config) -> str:
        """What a usable row has, for the error when no row is kept (``"a non-blank prompt and ..."``)."""
        raise NotImplementedError

    def tokenize(self, dsd, tokenizer, cfg: Config) -> tuple[object, dict[str, int], int]:
        """``(dsd with input_ids, attention_mask, length, and the format's own columns, {reason: rows dropped
        by tokenization}, rows truncated)``. Raises DataError for data the tokenizer cannot use."""
        raise NotImplementedError

    def deduplicate(self, rows: Rows) -> tuple[Rows, dict[str, int]]:
        """Drop the empty rows (:meth:`empty`), then exact repeats of an earlier kept row (:meth:`key`), in order.

        Returns:
            the kept rows (source order) and ``{reason: rows}`` for every reason in :attr:`drop_reasons`
            (zeros included; those of tokenization stay 0 here); kept + sum(dropped) == rows read.
        """
        records, labels, dropped = splits.drop_rows(rows.records(), rows.labels, self.drop_reasons, self.key,
                                                    self.empty)
        return rows.kept(records, labels), dropped

    def split(self, rows: Rows, cfg: Config):
        """The seeded, stratified train/validation/test ``DatasetDict`` (:func:`onegpu.data.splits.split`)."""
        return splits.split(rows.columns, rows.labels, cfg.data, cfg.model.task)

    def texts(self, ds) -> list[str]:
        """:meth:`key` of every row of ``ds`` (a ``datasets.Dataset`` of this format): what a tokenizer
        prepare trains (``model.name_or_path: null``) learns from."""
        return [self.key(dict(zip(self.columns, cells))) for cells in zip(*(ds[c] for c in self.columns))]
