"""What the instruction readers share (onegpu.data.instructions): tables read into the format's columns, labels,
the row key."""
from __future__ import annotations

import pytest

from onegpu.data import messages, prompt_completion
from onegpu.errors import DataError
from tests.unit.data.rows import cfg, write_csv, write_jsonl


def test_a_label_column_stratifies_and_without_one_every_row_is_text(tmp_path):
    path = write_csv(tmp_path / "d.csv", [("q1", "a1", "x"), ("q2", "a2", "")],
                     header=("prompt", "completion", "topic"))
    assert prompt_completion.READER.read(cfg(path, label_column="topic")).labels == ["x", "text"]
    assert prompt_completion.READER.read(cfg(path)).labels == ["text", "text"]


def test_a_table_without_the_formats_columns_or_rows_is_one_line(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "q"}])
    with pytest.raises(DataError, match=r"has neither prompt \+ completion, chosen \+ rejected nor messages "
                                          r"columns \(columns: prompt\)"):
        prompt_completion.READER.read(cfg(path))
    with pytest.raises(DataError, match="has neither prompt"):
        messages.READER.read(cfg(path))
    with pytest.raises(DataError, match="the file has a header but no rows"):
        prompt_completion.READER.read(cfg(write_csv(tmp_path / "e.csv", [], header=("prompt", "completion"))))


def test_the_row_key_is_its_cells_as_sorted_key_json():
    row = {"prompt": "é", "completion": "c", "label": 3}
    assert prompt_completion.READER.key(row) == '{"completion": "c", "prompt": "é"}'
    turns = [{"role": "user", "content": "u"}]
    assert messages.READER.key({"messages": turns}) == '{"messages": [{"content": "u", "role": "user"}]}'
