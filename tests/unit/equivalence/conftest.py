"""The from-config model's two shapes (float64.py's ``SHAPES``): a proof that takes ``from_config_shape`` runs
on the narrow twin in ``make test`` and on SmolLM2-135M-Instruct's width in ``make test-all`` (``slow``)."""
from __future__ import annotations

import pytest

from tests.unit.equivalence import float64


@pytest.fixture(params=["narrow", pytest.param("smollm2", marks=pytest.mark.slow)])
def from_config_shape(request):
    with float64.model_shape(request.param):
        yield request.param
