"""Fixtures shared by the unit tests: project roots with their own MLflow store, never the user's."""
from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def fresh_root(tmp_path, monkeypatch) -> Path:
    """An empty project root: DVC_ROOT points at it, MLFLOW_TRACKING_URI is unset, cwd is elsewhere."""
    root = (tmp_path / "proj").resolve()
    root.mkdir()
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("DVC_ROOT", str(root))
    monkeypatch.chdir(cwd)  # nothing may land in the cwd (DVC's temp clone in real use)
    return root


@pytest.fixture(scope="module")
def store_root(tmp_path_factory) -> Path:
    """One project root per test module, the environment pointing at it for the module's tests
    (DVC_ROOT, no MLFLOW_TRACKING_URI, cwd): ``tracking.connect`` opens ``<root>/mlflow.db``.
    Creating a fresh SQLite store costs a few seconds (schema migrations), so a module shares one."""
    root = tmp_path_factory.mktemp("store").resolve()
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        mp.setenv("DVC_ROOT", str(root))
        mp.chdir(root)
        yield root


@pytest.fixture(scope="module")
def minilm():
    """The packaged MiniLM-L6 classifier (5 labels, seed 0) and one micro-batch of 8 rows (10-64 tokens)."""
    import torch

    from onegpu.models import loader
    loader.go_offline()
    path = loader.resolve_model_path("packaged:all-MiniLM-L6-v2")
    tok = loader.load_tokenizer(path, "sequence-classification")
    torch.manual_seed(0)
    model = loader.build_classifier(path, ["a", "b", "c", "d", "e"], dropout=None)
    texts = [("word " * n).strip() for n in (60, 40, 64, 10, 50, 64, 30, 64)]
    batch = dict(tok(texts, truncation=True, max_length=64, padding=True, return_tensors="pt"))
    batch["labels"] = torch.tensor([0, 1, 2, 3, 4, 0, 1, 2])
    return model, batch


@pytest.fixture
def collector(monkeypatch):
    """This process's interpreter put back after the test as ``onegpu.interpreter.start`` found it: the
    garbage collector (threshold, frozen objects, the atexit freeze), stdout and stderr (``Tolerant``
    wrappers), the SIGTERM and SIGHUP handlers; and ``interpreter`` as if no command had started."""
    import atexit
    import gc
    import signal
    import sys

    from onegpu import interpreter
    before = gc.get_threshold()
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
    monkeypatch.setattr(interpreter, "_starting", False)
    monkeypatch.setattr(sys, "stdout", sys.stdout)
    monkeypatch.setattr(sys, "stderr", sys.stderr)
    yield
    for s, h in handlers.items():
        signal.signal(s, h)
    atexit.unregister(gc.freeze)
    gc.unfreeze()
    gc.set_threshold(*before)
