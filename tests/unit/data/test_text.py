"""Text data (onegpu.data.text): user tables and text trees read with values as written, every dropped row
counted by reason."""
from __future__ import annotations

import json

import pytest

from onegpu.config import DataConfig
from onegpu.data import check_source, splits, text
from onegpu.errors import DataError
from tests.unit.data.rows import classify, data_cfg, tree, write_csv


def read(path: str, **kw):
    return text.read_table(DataConfig(source=path, **kw))


def dedup(raw):
    """``(texts, labels, dropped)`` kept by the text reader's de-duplication."""
    kept, dropped = text.READER.deduplicate(raw)
    return kept.columns["text"], kept.labels, dropped


def test_csv_integer_labels_keep_their_spelling_and_the_empty_label_is_counted(tmp_path):
    # 90 rows with labels 1, 7, -1 and one row whose label cell is empty: pandas alone reads the column
    # as float (1.0, 7.0, -1.0, NaN) and drops the NaN row without a word.
    rows = [(f"text number {i}", lab) for i, lab in enumerate(["1", "7", "-1"] * 30)] + [("no label", "")]
    raw = read(write_csv(tmp_path / "d.csv", rows))
    assert len(raw.columns["text"]) == 91
    assert sorted(set(raw.labels)) == ["", "-1", "1", "7"]
    texts, labels, dropped = dedup(raw)
    assert dropped == {"empty_text": 0, "empty_label": 1, "duplicate": 0}
    assert len(texts) == 90
    dsd = splits.split({"text": texts}, labels, data_cfg("d.csv"))
    assert dsd["train"].features["label"].names == ["-1", "1", "7"]


def test_blank_texts_are_empty_not_duplicates_and_every_row_is_accounted_for(tmp_path):
    rows = ([("", "a")] * 10 + [("   ", "b")] * 5 + [("\t ", "a")] * 5      # 20 blank texts
            + [(f"row {i}", "ab"[i % 2]) for i in range(30)]                    # 30 good rows
            + [("row 3", "b"), ("row 4", "a")]                                  # 2 repeats
            + [("labelless", "  ")])                                            # 1 blank label
    raw = read(write_csv(tmp_path / "d.csv", rows))
    texts, labels, dropped = dedup(raw)
    assert len(raw.columns["text"]) == 53
    assert dropped == {"empty_text": 20, "empty_label": 1, "duplicate": 2}
    assert len(texts) == 30 and len(texts) + sum(dropped.values()) == len(raw.columns["text"])
    assert labels[3] == "b" and texts[3] == "row 3"  # the first of a repeated text is kept


def test_na_like_cells_are_text_not_missing(tmp_path):
    rows = [("NA", "None"), ("null", "NaN"), ("n/a", "")]
    raw = read(write_csv(tmp_path / "d.csv", rows))
    assert raw.columns["text"] == ["NA", "null", "n/a"]
    assert raw.labels == ["None", "NaN", ""]


def test_jsonl_numbers_booleans_and_null_keep_json_spelling(tmp_path):
    lines = [{"text": "one", "label": 1}, {"text": "seven", "label": 7}, {"text": "minus", "label": -1},
             {"text": "half", "label": 1.5}, {"text": "yes", "label": True}, {"text": "none", "label": None},
             {"text": "absent"}, {"text": 42, "label": "x"}, {"text": None, "label": "x"},
             {"text": "  ", "label": "x"}, {"text": "one", "label": 1}]
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")  # a trailing blank line is not a row
    raw = read(str(p))
    assert raw.labels == ["1", "7", "-1", "1.5", "true", "", "", "x", "x", "x", "1"]
    assert raw.columns["text"][7] == "42"
    texts, labels, dropped = dedup(raw)
    assert dropped == {"empty_text": 2, "empty_label": 2, "duplicate": 1}
    assert labels == ["1", "7", "-1", "1.5", "true", "x"]
    assert len(texts) + sum(dropped.values()) == len(raw.columns["text"]) == 11


@pytest.mark.parametrize("content, message", [
    ('{"text": "a", "label": "x"}\n{"text": "b", "label": ["x"]}\n',
     r"data.label_column='label': line 2 holds a JSON list"),
    ('{"text": "a", "label": "x"}\n[1, 2]\n', r"line 2 is a JSON list; each line must be an object"),
    ('{"text": "a", "label": "x"}\n{"text": oops}\n', r"cannot parse line 2 as JSON"),
    ('{"body": "a", "label": "x"}\n', r"data.text_column='text' is not a field .* \(fields: body, label\)"),
])
def test_jsonl_nested_value_and_bad_line_name_the_line(tmp_path, content, message):
    p = tmp_path / "d.jsonl"
    p.write_text(content)
    with pytest.raises(DataError, match=message):
        read(str(p))


def test_a_csv_without_a_column_names_the_csv_columns_and_a_causal_lm_needs_no_label(tmp_path):
    path = write_csv(tmp_path / "d.csv", [("a", "b")], header=("text", "topic"))
    with pytest.raises(DataError, match=r"data.label_column='label' is not a column of .*d.csv "
                                        r"\(columns: text, topic\)"):
        read(path)
    raw = text.read_table(DataConfig(source=path), label_required=False)
    assert raw.columns["text"] == ["a"] and raw.labels == [text.NO_LABEL]
    with pytest.raises(DataError, match="the file has a header but no rows"):
        read(write_csv(tmp_path / "e.csv", []))


def test_directory_source_counts_empty_files(tmp_path, monkeypatch):
    files = {f"{lab}/{i}.txt": f"{lab} story {i}" for lab in ("sport", "tech") for i in range(5)}
    files.update({"sport/empty.txt": "", "tech/blank.txt": " \n\n", "tech/again.txt": "tech story 1",
                  "tech/notes.md": "not read"})
    tree(tmp_path / "texts", files)
    monkeypatch.chdir(tmp_path)
    cfg = classify("texts")  # relative, as in params.yaml
    check_source(cfg.data)
    raw = text.READER.read(cfg)
    assert len(raw.columns["text"]) == 13
    texts, labels, dropped = dedup(raw)
    assert dropped == {"empty_text": 2, "empty_label": 0, "duplicate": 1}
    assert sorted(set(labels)) == ["sport", "tech"] and len(texts) == 10


def test_the_packaged_corpus_is_read_as_its_text_files():
    raw = text.READER.read(classify("bbcnews"))
    assert len(raw) == 2225 and raw.undecodable == 1
    assert sorted(set(raw.labels)) == ["business", "entertainment", "politics", "sports", "tech"]
    kept, dropped = text.READER.deduplicate(raw)
    assert dropped == {"empty_text": 0, "empty_label": 0, "duplicate": 98} and len(kept) == 2127
