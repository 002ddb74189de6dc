"""The from-config model's two shapes (float64.py's ``SHAPES``): a proof that takes ``from_config_shape`` runs
on the narrow twin in ``make test`` and on SmolLM2-135M-Instruct's width in ``make test-all`` (``slow``; and
``big_memory``: a DPO proof at that width held 5.2 GB, and beside the packaged model's two sharded ranks it ran
the 24 GiB machine out of memory)."""
from __future__ import annotations

import pytest

from tests.unit.equivalence import float64


@pytest.fixture(params=["narrow", pytest.param("smollm2", marks=[pytest.mark.slow, pytest.mark.big_memory])])
def from_config_shape(request):
    with float64.model_shape(request.param):
        yield request.param
