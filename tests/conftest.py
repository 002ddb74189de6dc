"""Suite-wide isolation from the user's machine state.

- Per-user caches (``~/.cache/onegpu``: the measured CPU peak FLOP/s) go to a folder of this test
  session: a test never reads a figure the user's own runs cached, nor leaves one behind. Set before any
  ``onegpu`` module is imported, since modules resolve their cache paths at import.
- Each test starts in an empty folder of its own, so nothing can pick up the workspace's
  ``params.yaml`` or ``mlflow.db`` through the current directory; MLflow and DVC variables of the
  calling shell are cleared.
"""
from __future__ import annotations

import os
import tempfile

import pytest

_CACHE = tempfile.mkdtemp(prefix="onegpu-test-cache-")
os.environ["XDG_CACHE_HOME"] = _CACHE
os.environ["ONEGPU_CACHE_DIR"] = os.path.join(_CACHE, "onegpu")  # onegpu.flops reads it first


@pytest.fixture(autouse=True)
def _isolated_cwd(tmp_path_factory, monkeypatch):
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))
    for k in list(os.environ):
        if k.startswith(("MLFLOW_", "DVC_")):
            monkeypatch.delenv(k)


# -- shared fixtures: the packaged MiniLM tokenizer and a tiny 3-label dataset (32 rows of 4..34 tokens) --

LABELS = ["a", "b", "c"]


@pytest.fixture(scope="module")
def tokenizer():
    """The packaged all-MiniLM-L6-v2 tokenizer (no hub). Module-scoped."""
    from onegpu import models
    models.go_offline()
    return models.load_tokenizer(models.resolve_model_path("packaged:all-MiniLM-L6-v2"), "sequence-classification")


@pytest.fixture(scope="module")
def dsd(tokenizer):
    """32 texts of different lengths (micro-batches pad differently), labels a/b/c, tokenized to at most 32
    tokens with a ``length`` column; validation and test are 4-row slices. Module-scoped."""
    from datasets import ClassLabel, Dataset, DatasetDict
    texts = [" ".join(["token"] * (3 + (7 * i) % 29)) + f" {i}" for i in range(32)]
    ds = Dataset.from_dict({"text": texts, "label": [LABELS[i % 3] for i in range(32)]})
    ds = ds.cast_column("label", ClassLabel(names=LABELS))
    d = DatasetDict(train=ds, validation=ds.select(range(4)), test=ds.select(range(4)))

    def tok(b):
        enc = tokenizer(b["text"], truncation=True, max_length=32)
        enc["length"] = [len(x) for x in enc["input_ids"]]
        return enc
    return d.map(tok, batched=True)


def pytest_collection_modifyitems(config, items):
    """``gpu``-marked tests skip, with the reason, where torch sees no CUDA device."""
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    import torch
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


def pytest_sessionfinish(session, exitstatus):
    import shutil
    shutil.rmtree(_CACHE, ignore_errors=True)
