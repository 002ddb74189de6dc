"""onegpu.config.knobs: a key must say whether it is in the equivalence key."""
from __future__ import annotations

import pytest

from onegpu import config


def test_a_knob_must_say_whether_it_is_in_the_key():
    with pytest.raises(TypeError, match="IN_KEY"):
        config.knob(1, help="a new knob", key="maybe")
