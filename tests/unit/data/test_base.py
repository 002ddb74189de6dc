"""The readers' interface (onegpu.data.base): rows as columns, de-duplication through the reader's rules."""
from __future__ import annotations

from onegpu.data import base, text


def test_rows_are_columns_and_records_alike():
    rows = base.Rows({"prompt": ["p1", "p2", "p3"], "completion": ["c1", "c2", "c3"]}, ["a", "b", "a"], "s", 1)
    assert len(rows) == 3 and rows.records()[1] == {"prompt": "p2", "completion": "c2"}
    head = rows.head(2)
    assert head.columns == {"prompt": ["p1", "p2"], "completion": ["c1", "c2"]} and head.labels == ["a", "b"]
    kept = rows.kept([rows.records()[2]], ["a"])
    assert kept.columns == {"prompt": ["p3"], "completion": ["c3"]} and (kept.source, kept.undecodable) == ("s", 1)


def test_deduplicate_drops_by_the_readers_empty_and_key_in_order():
    rows = base.Rows({"text": ["x", "", "x", "y", "z"]}, ["a", "a", "b", "", "b"], "s")
    kept, dropped = text.READER.deduplicate(rows)
    assert kept.columns["text"] == ["x", "z"] and kept.labels == ["a", "b"]
    assert dropped == {"empty_text": 1, "empty_label": 1, "duplicate": 1}
