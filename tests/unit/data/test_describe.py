"""What prepare wrote, described (onegpu.data.describe): the stats per reason and split, the MLflow table."""
from __future__ import annotations

from onegpu.data import describe, formats, splits, text, tokens
from tests.unit.data.rows import data_cfg, write_csv


def test_stats_report_rows_dropped_per_reason(tmp_path):
    from transformers import AutoTokenizer

    from onegpu.config import DataConfig
    from onegpu.models import loader
    rows = [(f"story {i}", "ab"[i % 2]) for i in range(40)] + [("", "a"), ("story 1", "b"), ("x", "")]
    raw = text.read_table(DataConfig(source=write_csv(tmp_path / "d.csv", rows)))
    kept, dropped = text.READER.deduplicate(raw)
    dsd = splits.split(kept.columns, kept.labels, data_cfg("d.csv"))
    tok = AutoTokenizer.from_pretrained(loader.resolve_model_path("packaged:all-MiniLM-L6-v2"))
    dsd = tokens.tokenize(dsd, tok, 16)
    st = describe.stats(dsd, text.READER.texts, rows_read=len(raw), dropped=dropped, undecodable=0, max_length=16)
    assert st["rows_read"] == 43 and st["rows_kept"] == 40
    assert st["rows_dropped"] == {"empty_text": 1, "empty_label": 1, "duplicate": 1}
    assert st["duplicates_removed"] == 1
    assert sum(s["rows"] for s in st["splits"].values()) == 40
    assert st["fingerprint"] == describe.fingerprint(dsd, text.READER.texts)
    metrics = describe.metrics(st, 0)
    assert metrics["rows_dropped_empty_label"] == 1 and metrics["rows_train"] == st["splits"]["train"]["rows"]


def test_the_mlflow_table_holds_the_formats_columns_with_messages_as_json_text():
    msgs = [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hé"}]] * 2
    ds = splits.dataset({"messages": msgs}, ["b", "a"], ["a", "b"])
    df = describe.table(ds, formats.COLUMNS[formats.MESSAGES])
    assert list(df.columns) == ["messages", "label"] and list(df["label"]) == ["b", "a"]
    assert df["messages"][0] == '[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hé"}]'
    df = describe.table(splits.dataset({"prompt": ["p"], "completion": ["c"]}, ["a"], ["a"]), ("prompt", "completion"))
    assert df.to_dict("records") == [{"prompt": "p", "completion": "c", "label": "a"}]
