"""Packing (onegpu.data.packing): TRL's best-fit-decreasing packer over whole examples."""
from __future__ import annotations

from onegpu.data import packing


def test_examples_are_packed_whole_and_text_rows_get_every_token_as_target():
    from datasets import Dataset
    rows = Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]], "length": [3, 2, 4, 1]})
    packed = packing.pack(rows, 5, seed=0)
    assert sorted(sum(packed["seq_lengths"], [])) == [1, 2, 3, 4]
    assert all(sum(lengths) <= 5 for lengths in packed["seq_lengths"])
    assert sorted(sum(packed["input_ids"], [])) == list(range(1, 11)) and packed["labels"] == packed["input_ids"]
