"""Tokenization (onegpu.data.tokens): text rows whole, instruction rows from their own columns with their masks."""
from __future__ import annotations

import pytest

from onegpu.config import DataConfig
from onegpu.data import IGNORE_INDEX, formats, splits, tokens
from onegpu.errors import DataError


@pytest.fixture(scope="module")
def tok():
    from tests.unit.training.objectives import test_batches as tp
    return tp.tokenizer()


def _dsd(columns: dict, n: int):
    from datasets import DatasetDict
    return DatasetDict(train=splits.dataset(columns, ["text"] * n, ["text"]))


def test_causal_lm_text_ends_with_eos_and_classification_text_does_not(tok):
    dsd = _dsd({"text": ["Rates rise", "Rates fall"]}, 2)
    lm, cls = tokens.tokenize(dsd, tok, 16, "causal-lm"), tokens.tokenize(dsd, tok, 16)
    assert lm["train"]["input_ids"][0] == cls["train"]["input_ids"][0] + [tok.eos_token_id]
    assert lm["train"]["length"] == [len(x) for x in lm["train"]["input_ids"]]


def test_a_max_length_above_the_models_limit_is_one_line(tok, monkeypatch):
    monkeypatch.setattr(tok, "model_max_length", 8)
    with pytest.raises(DataError, match="data.max_length=16 is longer than the model's limit of 8 tokens"):
        tokens.tokenize(_dsd({"text": ["x"]}, 1), tok, 16)


def test_instruction_rows_are_read_from_their_columns(tok):
    dsd = _dsd({"prompt": ["Write the headline.", "Write it.", "Write the headline. " + "Long body. " * 30],
                "completion": ["Rates rise", "x " * 80, "Short"]}, 3)
    out, dropped, truncated = tokens.tokenize_instructions(dsd, tok, DataConfig(max_length=48),
                                                           formats.PROMPT_COMPLETION)
    assert dropped == 1 and truncated == 1  # the second answer cannot fit at all; the third's prompt is cut
    assert len(out["train"]) == 2 and out["train"][1]["length"] <= 48
    row = out["train"][0]
    assert row["prompt"] == "Write the headline." and row["reference"] == "Rates rise"
    assert row["labels"][:row["prompt_length"]] == [IGNORE_INDEX] * row["prompt_length"]
    msgs = [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]]
    out, _, _ = tokens.tokenize_instructions(_dsd({"messages": msgs}, 1), tok, DataConfig(max_length=64),
                                             formats.MESSAGES)
    assert out["train"][0]["messages"] == msgs[0] and out["train"][0]["reference"] == "hello"


def test_no_row_of_a_split_that_fits_is_one_line(tok):
    dsd = _dsd({"prompt": ["p"], "completion": ["word " * 80]}, 1)
    with pytest.raises(DataError, match="no train row fits data.max_length=32 tokens with its whole answer"):
        tokens.tokenize_instructions(dsd, tok, DataConfig(max_length=32), formats.PROMPT_COMPLETION)
