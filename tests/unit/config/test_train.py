"""onegpu.config.train: the section's derived values."""
from __future__ import annotations

import pytest

from onegpu import config


@pytest.mark.parametrize("bf16, fp16, expected", [(True, False, "bf16"), (False, True, "fp16"), (False, False, "no")])
def test_mixed_precision_from_the_flags(bf16, fp16, expected):
    assert config.TrainConfig(bf16=bf16, fp16=fp16).mixed_precision == expected
