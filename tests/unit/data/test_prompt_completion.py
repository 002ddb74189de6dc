"""Prompt-completion data (onegpu.data.prompt_completion): tables of every kind read alike, the packaged
headlines."""
from __future__ import annotations

from onegpu.data import check_input, formats, prompt_completion
from tests.unit.data.rows import cfg


def test_parquet_and_csv_instruction_tables_read_the_same_rows(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    rows = [{"prompt": f"question {i}", "completion": f"answer {i}"} for i in range(3)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    (tmp_path / "d.csv").write_text("prompt,completion\n" + "".join(f"question {i},answer {i}\n" for i in range(3)))
    for name in ("d.parquet", "d.csv"):
        data = prompt_completion.READER.read(cfg(str(tmp_path / name)))
        assert check_input(cfg(str(tmp_path / name))) == formats.PROMPT_COMPLETION and data.records() == rows


def test_headlines_are_the_first_line_of_each_article():
    data = prompt_completion.headlines()
    assert len(data) == 2225 and set(data.labels) == {"business", "entertainment", "politics", "sports", "tech"}
    first = data.records()[0]
    assert first["prompt"].startswith(prompt_completion.HEADLINE_INSTRUCTION) and "\n" not in first["completion"]
    rows, dropped = prompt_completion.READER.deduplicate(data)
    assert dropped["duplicate"] == 98 and len(rows) == 2127
