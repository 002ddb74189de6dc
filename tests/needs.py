"""A system tool a test needs (Chromium, PostgreSQL's server): where it is missing the test skips,
saying what to install, except under CI (``CI=true``, which ``.ci/run`` sets after installing every tool
the suite needs), where a missing tool is a failure: a CI that skipped the browser test would pass
without ever opening the UI. Not a test module."""
from __future__ import annotations

import os
from typing import NoReturn

import pytest


def under_ci() -> bool:
    """Whether this run is CI's (``CI`` set to true, 1 or yes, as CI services and ``.ci/run`` set it)."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def missing(what: str) -> NoReturn:
    """Skip the test for a missing ``what`` (how to install it), or fail it under CI."""
    if under_ci():
        pytest.fail(f"{what}; CI=true, and .ci/run installs it: a test CI needs does not skip there")
    pytest.skip(what)
