"""Moved to tests/unit/training/test_batches.py (the padding-free collators are training/batches.py's). Only
the packaged SmolLM2 tokenizer helper is re-exported here, for tests/unit/test_chat.py's
``from tests.unit import test_padding_free``; delete this file once that import names test_batches."""
from tests.unit.training.test_batches import tokenizer  # noqa: F401
