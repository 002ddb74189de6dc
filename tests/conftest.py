"""Fixtures for every test: nothing reads or writes the user's ~/.cache."""
from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _private_peak_cache(tmp_path_factory, monkeypatch):
    """Measured device peaks (``onegpu.flops``) go to a per-session temporary folder, also for the
    ``dvc``/``onegpu`` subprocesses the integration tests start (they inherit the environment)."""
    monkeypatch.setenv("ONEGPU_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "onegpu-cache"))
