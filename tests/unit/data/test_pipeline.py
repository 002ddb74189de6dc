"""Prepare's work without MLflow (onegpu.data.pipeline): the reader of the format does every step, instruction
rows stay columns, the estimate's sample is prepare's own rows."""
from __future__ import annotations

import json

import pytest

from onegpu.data import base, check_input, formats, pipeline, readers
from onegpu.errors import DataError
from tests.unit.data.rows import cfg, write_jsonl


@pytest.fixture(scope="module")
def tok():
    from tests.unit.training.objectives import test_batches as tp
    return tp.tokenizer()


def test_drop_summary_line():
    assert pipeline.drop_summary({"empty_text": 10, "empty_label": 1, "duplicate": 0}) == \
        "11 dropped (empty text 10, empty label 1)"
    assert pipeline.drop_summary(dict.fromkeys(formats.DROP_REASONS[formats.TEXT], 0)) == "0 dropped"


def test_a_file_whose_completions_are_all_empty_names_prompt_and_completion(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"question {i}", "completion": " "} for i in range(3)])
    with pytest.raises(DataError) as e:
        pipeline.prepare(cfg(path), check_input(cfg(path)), make_tokenizer=None)
    assert str(e.value) == (f"data.source={path!r}: no row has a non-blank prompt and a non-blank completion "
                            "(3 rows read, 3 dropped (empty completion 3))")
    path = write_jsonl(tmp_path / "m.jsonl", [{"messages": []}] * 2)
    with pytest.raises(DataError, match=r"no row has a non-empty messages list of role/content turns \(2 rows read, "
                                        r"2 dropped \(empty messages 2\)\)"):
        pipeline.prepare(cfg(path), formats.MESSAGES, make_tokenizer=None)


def _rows(n: int) -> list[dict]:
    return [{"prompt": " ".join([f"Question number {i}:"] + ["why"] * (i % 5)), "completion": f"Answer {i}"}
            for i in range(n)]


def test_instruction_rows_travel_as_their_columns_never_as_json_text(tmp_path, tok):
    """Issue 31: the processed data holds prompt/completion (or messages) columns as read, no ``text``."""
    path = write_jsonl(tmp_path / "d.jsonl", _rows(20) + [_rows(1)[0]])
    dsd, _, stats, raw = pipeline.prepare(cfg(path, max_length=64), formats.PROMPT_COMPLETION, lambda texts: tok)
    assert stats["rows_dropped"]["duplicate"] == 1 and len(raw) == 21
    for split in dsd.values():
        assert "text" not in split.column_names
        assert {"prompt", "completion", "label", "input_ids", "labels", "prompt_length", "reference"} <= set(
            split.column_names)
        assert split.features["prompt"].dtype == split.features["completion"].dtype == "string"
        for row in split:
            assert {"prompt": row["prompt"], "completion": row["completion"]} in _rows(20)  # the cells as written
            assert row["reference"] == row["completion"]
    msgs = [{"messages": [{"role": "user", "content": f"Say {i}"}, {"role": "assistant", "content": f"{i}"}]}
            for i in range(20)]
    path = write_jsonl(tmp_path / "m.jsonl", msgs)
    dsd, _, _, _ = pipeline.prepare(cfg(path, max_length=64), formats.MESSAGES, lambda texts: tok)
    assert "text" not in dsd["train"].column_names
    assert all({"messages": r["messages"]} in msgs for r in dsd["train"])


def test_the_fingerprint_hashes_each_row_as_the_json_prepare_once_kept_in_text(tmp_path, tok):
    """The fingerprint (and so the data.fingerprint tag resumes compare) stays what it was when rows
    travelled as sorted-key JSON in a ``text`` column."""
    import hashlib
    path = write_jsonl(tmp_path / "d.jsonl", _rows(20))
    dsd, _, stats, _ = pipeline.prepare(cfg(path, max_length=64), formats.PROMPT_COMPLETION, lambda texts: tok)
    h = hashlib.sha256()
    for s in ("train", "validation", "test"):
        for r in dsd[s]:
            old_text = json.dumps({"prompt": r["prompt"], "completion": r["completion"]}, ensure_ascii=False,
                                  sort_keys=True)
            h.update(f"{s}\t{r['label']}\t{old_text}\n".encode())
    assert stats["fingerprint"] == h.hexdigest()[:16]


def test_the_sample_is_prepares_first_kept_rows_tokenized_as_prepare_does(tmp_path, tok):
    rows = _rows(30)
    rows[3] = {"prompt": "", "completion": "dropped: no prompt"}
    path = write_jsonl(tmp_path / "d.jsonl", rows + rows[:2])
    c = cfg(path, max_length=64)
    dsd, _, _, _ = pipeline.prepare(c, formats.PROMPT_COMPLETION, lambda texts: tok)
    sample, tokenizer = pipeline.sample(c, formats.PROMPT_COMPLETION, lambda texts: tok, 8)
    kept = [r for i, r in enumerate(rows) if i != 3][:8]
    assert tokenizer is tok and list(sample) == ["train"]
    assert [{"prompt": r["prompt"], "completion": r["completion"]} for r in sample["train"]] == kept
    prepared = {r["prompt"]: r for s in dsd.values() for r in s}
    for r in sample["train"]:
        assert r == prepared[r["prompt"]]  # every column: ids, labels, masks, prompt length, reference, label


def test_prepare_knows_no_format_it_asks_the_registered_reader(monkeypatch, tmp_path):
    """A reader registered under a new format name is all prepare needs: no branch on the format."""
    class Fake(base.Reader):
        format, columns, drop_reasons = "fake", ("text",), ("duplicate",)

        def read(self, cfg):
            return base.Rows({"text": [f"row {i % 48}" for i in range(60)]}, ["a", "b", "c"] * 20, "fake://")

        def empty(self, row, label):
            return None

        def key(self, row):
            return row["text"]

        def needs(self, cfg):
            return "something"

        def tokenize(self, dsd, tokenizer, cfg):
            return dsd.map(lambda ex: {"input_ids": [1] * len(ex["text"]), "length": len(ex["text"])}), {}, 0

    monkeypatch.setitem(readers.READERS, "fake", Fake())
    c = cfg("unused.jsonl", "sequence-classification")
    dsd, tokenizer, stats, _ = pipeline.prepare(c, "fake", lambda texts: sorted(texts))
    assert stats["format"] == "fake" and stats["rows_dropped"] == {"duplicate": 12} and stats["rows_kept"] == 48
    assert tokenizer == sorted(dsd["train"]["text"])
