"""Which kind of data a source holds (onegpu.data.formats), as TRL decides it, and the message cells."""
from __future__ import annotations

import pytest

from onegpu.data import formats
from onegpu.errors import DataError


def test_the_format_comes_from_the_columns_in_trls_order():
    assert formats.detect(["messages", "prompt", "completion"]) == formats.MESSAGES
    assert formats.detect(["prompt", "completion", "label"]) == formats.PROMPT_COMPLETION
    assert formats.detect(["prompt", "label"]) == formats.TEXT
    assert formats.detect(["prompt", "chosen", "rejected", "completion"]) == formats.PREFERENCE
    assert formats.detect(["chosen", "rejected"]) == formats.PREFERENCE  # the implicit prompt
    assert formats.detect(["prompt", "chosen"]) == formats.TEXT
    assert formats.detect(["prompt", "answer", "label"]) == formats.PROMPT_ANSWER  # GRPO's
    assert formats.detect(["prompt", "completion", "answer"]) == formats.PROMPT_COMPLETION  # a completion: SFT's
    assert formats.detect(["answer", "text"]) == formats.TEXT
    assert set(formats.COLUMNS) == set(formats.DROP_REASONS) == {formats.TEXT, formats.PROMPT_COMPLETION,
                                                                 formats.MESSAGES, formats.PREFERENCE,
                                                                 formats.PROMPT_ANSWER}


def test_is_conversational_is_trls_test():
    assert formats.is_conversational([{"role": "user", "content": "x"}])
    assert not formats.is_conversational([]) and not formats.is_conversational("x")


def test_a_message_cell_is_normalised_or_refused_naming_where():
    cell = [{"role": "user", "content": "u", "extra": 1}]
    assert formats.messages_cell(cell, "row 1", "d.jsonl") == [{"role": "user", "content": "u"}]
    assert formats.messages_cell('[{"role": "user", "content": "u"}]', "row 1", "d.csv", csv_text=True) == [
        {"role": "user", "content": "u"}]
    with pytest.raises(DataError, match=r"row 2: messages\[0\] has role 'robot'"):
        formats.messages_cell([{"role": "robot", "content": "u"}], "row 2", "d.jsonl")
    with pytest.raises(DataError, match="row 3 has no assistant turn"):
        formats.check_roles([{"role": "user", "content": "u"}], "row 3", "d.jsonl", True)
