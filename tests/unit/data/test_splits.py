"""The seeded, stratified splits (onegpu.data.splits): which row goes where depends on labels and seed only."""
from __future__ import annotations

import pytest

from onegpu.data import splits
from onegpu.errors import DataError
from tests.unit.data.rows import data_cfg


def test_the_split_is_the_same_whatever_the_rows_columns_hold():
    labels = ["a", "b", "c"] * 20
    texts = [f"text {i}" for i in range(60)]
    by_text = splits.split({"text": texts}, labels, data_cfg("d.csv"))
    by_columns = splits.split({"prompt": texts, "completion": [t.upper() for t in texts]}, labels,
                              data_cfg("d.csv"), "causal-lm")
    for s in splits.SPLITS:
        assert by_text[s]["text"] == by_columns[s]["prompt"] and by_text[s]["label"] == by_columns[s]["label"]
    assert by_text["train"].features["label"].names == ["a", "b", "c"]


def test_too_few_rows_or_labels_are_one_line(tmp_path):
    with pytest.raises(DataError, match="a single label"):
        splits.split({"text": ["x"] * 9}, ["a"] * 9, data_cfg("d.csv"))
    with pytest.raises(DataError, match="labels with fewer than 3 rows"):
        splits.split({"text": ["x"] * 9}, ["a"] * 7 + ["b"] * 2, data_cfg("d.csv"))
    with pytest.raises(DataError, match="no row has a non-blank text"):
        splits.split({"text": []}, [], data_cfg("d.csv"))


def test_a_column_of_strings_and_lists_of_messages_is_one_line():
    cells = ["a prompt", [{"role": "user", "content": "a conversational prompt"}]]
    with pytest.raises(DataError, match="must each hold cells of one type"):
        splits.dataset({"prompt": cells, "completion": ["c", "d"]}, ["a", "a"], ["a"])


def test_drop_rows_keeps_the_first_of_repeats_and_counts_every_reason():
    kept, labels, dropped = splits.drop_rows(["x", "", "x", "y"], [1, 2, 3, 4], ("empty", "duplicate"), str,
                                             lambda item, label: "empty" if not item else None)
    assert kept == ["x", "y"] and labels == [1, 4] and dropped == {"empty": 1, "duplicate": 1}
