"""tests/needs.py: a missing system tool skips a test, except under CI, where it fails it."""
from __future__ import annotations

import pytest

from tests import needs


@pytest.mark.parametrize("value, ci", [("true", True), ("1", True), ("", False), ("false", False)])
def test_a_missing_tool_fails_under_ci_and_skips_elsewhere(monkeypatch, value, ci):
    monkeypatch.setenv("CI", value)
    outcome = pytest.fail.Exception if ci else pytest.skip.Exception
    with pytest.raises(outcome, match="no chromium on PATH"):
        needs.missing("no chromium on PATH (apt-get install -y chromium chromium-driver)")
