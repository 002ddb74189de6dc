"""The files behind data.source (onegpu.data.files): the source checks, the record readers (one CSV reader,
pandas, for the early check and prepare alike), ``<label>/*.txt`` trees."""
from __future__ import annotations

import pytest

from onegpu.data import files
from onegpu.errors import DataError
from tests.unit.data.rows import data_cfg, tree, write_csv, write_jsonl


def test_config_accepts_a_directory_source_and_refuses_other_files(tmp_path, monkeypatch):
    from onegpu.config import Config, validate
    from onegpu.errors import ConfigError
    monkeypatch.chdir(tmp_path)
    (tmp_path / "texts").mkdir()
    cfg = Config()
    cfg.data.source = "texts"
    validate(cfg)
    cfg.data.source = "notes.txt"
    with pytest.raises(ConfigError, match=r"data.source: must be 'bbcnews', 'bbcnews-headlines', "
                                          r"'bbcnews-headline-pairs', 'bbcnews-sections', a .csv, .jsonl or "
                                          r".parquet file, or a directory"):
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
        files.check_source(data_cfg("mine.csv"))
    # In the user's repo itself, a missing file is just missing.
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError, match="no such file"):
        files.check_source(data_cfg("other.csv"))


def test_records_of_each_table_format_with_their_numbering(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    rows = [{"text": "a", "label": "x"}, {"text": "b", "label": "y"}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    csv_table = files.read_records(write_csv(tmp_path / "d.csv", [("a", "x"), ("b", "y")]), "")
    jsonl = files.read_records(write_jsonl(tmp_path / "d.jsonl", rows), "")
    parquet = files.read_records(str(tmp_path / "d.parquet"), "")
    for table, unit in ((csv_table, "row"), (jsonl, "line"), (parquet, "row")):
        assert table.records == [(1, rows[0]), (2, rows[1])] and list(table.columns) == ["text", "label"]
        assert table.unit == unit


def test_a_csv_is_read_by_pandas_with_cells_as_written_and_parse_errors_named(tmp_path):
    p = tmp_path / "d.csv"
    p.write_text("text,label\n1,007\nNA,\n\n")
    assert [r for _, r in files.read_records(str(p), "").records] == [{"text": "1", "label": "007"},
                                                                      {"text": "NA", "label": ""}]
    p.write_text('text,label\na,b\nc,d,e\n')
    with pytest.raises(DataError, match=r"data.source='.*d.csv': cannot parse: Error tokenizing data"):
        files.read_records(str(p), "")
    p.write_bytes(b"")
    with pytest.raises(DataError, match="the file is empty"):
        files.read_records(str(p), "")


def test_the_early_check_reads_a_csv_header_as_prepare_reads_the_file(tmp_path):
    p = tmp_path / "d.csv"
    p.write_text("\ntext,text\na,b\n")  # a leading blank line, a repeated name: pandas's columns either way
    assert files.header(p) == (list(files.read_records(str(p), "").columns), None) == (["text", "text.1"], None)
    p.write_text("\n\n")
    with pytest.raises(DataError, match=r"the file is empty \(a CSV needs a header line\)"):
        files.header(p)
    write_jsonl(tmp_path / "d.jsonl", [{"a": 1}, {"b": 2}])
    assert files.header(tmp_path / "d.jsonl") == (["a"], {"a": 1})  # the first record only


def test_a_text_tree_is_its_txt_files_and_one_that_has_none_is_refused(tmp_path):
    tree(tmp_path, {"b/1.txt": "beta", "a/2.txt": "alpha", "a/notes.md": "not read"})
    (tmp_path / "a" / "3.txt").write_bytes(b"caf\xe9")
    found, bad = files.text_files(tmp_path)
    assert found == [("a", "alpha"), ("a", "café"), ("b", "beta")] and bad == 1
    with pytest.raises(DataError, match="holds no <label>/\\*.txt files"):
        files.text_files(tmp_path / "a")
