"""Reading user tables and text trees: values as written, every dropped row counted by reason."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from onegpu import data
from onegpu.config import DataConfig
from onegpu.errors import DataError


def _csv(path: Path, rows, header=("text", "label")) -> str:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
    return str(path)


def _cfg(source: str, **kw) -> DataConfig:
    return DataConfig(source=source, validation_size=0.1, test_size=0.2, seed=0, **kw)


def test_csv_integer_labels_keep_their_spelling_and_the_empty_label_is_counted(tmp_path):
    # 90 rows with labels 1, 7, -1 and one row whose label cell is empty: pandas alone reads the column
    # as float (1.0, 7.0, -1.0, NaN) and drops the NaN row without a word.
    rows = [(f"text number {i}", lab) for i, lab in enumerate(["1", "7", "-1"] * 30)] + [("no label", "")]
    raw = data.read_table(_csv(tmp_path / "d.csv", rows), "text", "label")
    assert len(raw.texts) == 91
    assert sorted(set(raw.labels)) == ["", "-1", "1", "7"]
    texts, labels, dropped = data.deduplicate(raw)
    assert dropped == {"empty_text": 0, "empty_label": 1, "duplicate": 0}
    assert len(texts) == 90
    dsd = data.split(texts, labels, _cfg("d.csv"))
    assert dsd["train"].features["label"].names == ["-1", "1", "7"]


def test_blank_texts_are_empty_not_duplicates_and_every_row_is_accounted_for(tmp_path):
    rows = ([("", "a")] * 10 + [("   ", "b")] * 5 + [("\t ", "a")] * 5      # 20 blank texts
            + [(f"row {i}", "ab"[i % 2]) for i in range(30)]                    # 30 good rows
            + [("row 3", "b"), ("row 4", "a")]                                  # 2 repeats
            + [("labelless", "  ")])                                            # 1 blank label
    raw = data.read_table(_csv(tmp_path / "d.csv", rows), "text", "label")
    texts, labels, dropped = data.deduplicate(raw)
    assert len(raw.texts) == 53
    assert dropped == {"empty_text": 20, "empty_label": 1, "duplicate": 2}
    assert len(texts) == 30 and len(texts) + sum(dropped.values()) == len(raw.texts)
    assert labels[3] == "b" and texts[3] == "row 3"  # the first of a repeated text is kept


def test_na_like_cells_are_text_not_missing(tmp_path):
    rows = [("NA", "None"), ("null", "NaN"), ("n/a", "")]
    raw = data.read_table(_csv(tmp_path / "d.csv", rows), "text", "label")
    assert raw.texts == ["NA", "null", "n/a"]
    assert raw.labels == ["None", "NaN", ""]


def test_jsonl_numbers_booleans_and_null_keep_json_spelling(tmp_path):
    lines = [{"text": "one", "label": 1}, {"text": "seven", "label": 7}, {"text": "minus", "label": -1},
             {"text": "half", "label": 1.5}, {"text": "yes", "label": True}, {"text": "none", "label": None},
             {"text": "absent"}, {"text": 42, "label": "x"}, {"text": None, "label": "x"},
             {"text": "  ", "label": "x"}, {"text": "one", "label": 1}]
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")  # a trailing blank line is not a row
    raw = data.read_table(str(p), "text", "label")
    assert raw.labels == ["1", "7", "-1", "1.5", "true", "", "", "x", "x", "x", "1"]
    assert raw.texts[7] == "42"
    texts, labels, dropped = data.deduplicate(raw)
    assert dropped == {"empty_text": 2, "empty_label": 2, "duplicate": 1}
    assert labels == ["1", "7", "-1", "1.5", "true", "x"]
    assert len(texts) + sum(dropped.values()) == len(raw.texts) == 11


def test_jsonl_nested_value_and_bad_line_name_the_line(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"text": "a", "label": "x"}\n{"text": "b", "label": ["x"]}\n')
    with pytest.raises(DataError, match=r"data.label_column='label': line 2 holds a JSON list"):
        data.read_table(str(p), "text", "label")
    p.write_text('{"text": "a", "label": "x"}\n[1, 2]\n')
    with pytest.raises(DataError, match=r"line 2 is a JSON list; each line must be an object"):
        data.read_table(str(p), "text", "label")
    p.write_text('{"text": "a", "label": "x"}\n{"text": oops}\n')
    with pytest.raises(DataError, match=r"cannot parse line 2 as JSON"):
        data.read_table(str(p), "text", "label")
    p.write_text('{"body": "a", "label": "x"}\n')
    with pytest.raises(DataError, match=r"data.text_column='text' is not a field .* \(fields: body, label\)"):
        data.read_table(str(p), "text", "label")


def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_directory_source_counts_empty_files(tmp_path, monkeypatch):
    files = {f"{lab}/{i}.txt": f"{lab} story {i}" for lab in ("sport", "tech") for i in range(5)}
    files.update({"sport/empty.txt": "", "tech/blank.txt": " \n\n", "tech/again.txt": "tech story 1",
                  "tech/notes.md": "not read"})
    _tree(tmp_path / "texts", files)
    monkeypatch.chdir(tmp_path)
    cfg = _cfg("texts")  # relative, as in params.yaml
    data.check_source(cfg)
    raw = data.read(cfg)
    assert len(raw.texts) == 13
    texts, labels, dropped = data.deduplicate(raw)
    assert dropped == {"empty_text": 2, "empty_label": 0, "duplicate": 1}
    assert sorted(set(labels)) == ["sport", "tech"] and len(texts) == 10


def test_stats_report_rows_dropped_per_reason(tmp_path):
    from transformers import AutoTokenizer

    from onegpu.models import loader
    rows = [(f"story {i}", "ab"[i % 2]) for i in range(40)] + [("", "a"), ("story 1", "b"), ("x", "")]
    raw = data.read_table(_csv(tmp_path / "d.csv", rows), "text", "label")
    texts, labels, dropped = data.deduplicate(raw)
    dsd = data.split(texts, labels, _cfg("d.csv"))
    tok = AutoTokenizer.from_pretrained(loader.resolve_model_path("packaged:all-MiniLM-L6-v2"))
    dsd = data.tokenize(dsd, tok, 16)
    st = data.stats(dsd, rows_read=len(raw.texts), dropped=dropped, undecodable=0, max_length=16)
    assert st["rows_read"] == 43 and st["rows_kept"] == 40
    assert st["rows_dropped"] == {"empty_text": 1, "empty_label": 1, "duplicate": 1}
    assert st["duplicates_removed"] == 1
    assert sum(s["rows"] for s in st["splits"].values()) == 40


def test_drop_summary_line():
    from onegpu.data.pipeline import drop_summary
    assert drop_summary({"empty_text": 10, "empty_label": 1, "duplicate": 0}) == \
        "11 dropped (empty text 10, empty label 1)"
    assert drop_summary(dict.fromkeys(data.DROP_REASONS, 0)) == "0 dropped"


def test_config_accepts_a_directory_source_and_refuses_other_files(tmp_path, monkeypatch):
    from onegpu.config import Config, validate
    from onegpu.errors import ConfigError
    monkeypatch.chdir(tmp_path)
    (tmp_path / "texts").mkdir()
    cfg = Config()
    cfg.data.source = "texts"
    validate(cfg)
    cfg.data.source = "notes.txt"
    with pytest.raises(ConfigError, match=r"data.source: must be 'bbcnews', 'bbcnews-headlines', a .csv, .jsonl or .parquet file, or a directory"):
        validate(cfg)


def test_untracked_source_in_a_queued_experiment_says_git_or_dvc_add(tmp_path, monkeypatch):
    """DVC runs queued and --temp experiments in <repo>/.dvc/tmp/exps/<tmp>, a clone with only the files
    git or DVC track: a data file the user never added is missing there, not missing."""
    clone = tmp_path / ".dvc" / "tmp" / "exps" / "tmpabc"
    clone.mkdir(parents=True)
    (tmp_path / "mine.csv").write_text("text,label\na,b\n")
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))
    monkeypatch.chdir(clone)
    with pytest.raises(DataError, match=r"data.source='mine.csv' is in your repository .* neither git nor DVC "
                                        r"tracks it.*`git add mine.csv` \(small files\) or `dvc add mine.csv`"):
        data.check_source(_cfg("mine.csv"))
    # In the user's repo itself, a missing file is just missing.
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError, match="no such file"):
        data.check_source(_cfg("other.csv"))
