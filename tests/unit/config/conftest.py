"""The params every config test starts from."""
from __future__ import annotations

import pytest

from tests import defaults


@pytest.fixture
def raw() -> dict:
    """The repo's committed params.yaml as a plain dict (a fresh copy per test)."""
    return defaults.params()
