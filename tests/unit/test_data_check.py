"""The data's form checked first (onegpu.data.check.check_input) and instruction data read row by row
(onegpu.data.instructions): one line naming the problem, before any heavy import."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from onegpu.config import from_container
from onegpu.data import check_input, formats, instructions
from onegpu.errors import DataError


def cfg(source: str, task: str = "causal-lm", **data):
    model = {"task": task} if task != "causal-lm" else {"task": task, "name_or_path": None}
    return from_container({"data": {"source": source, **data}, "model": model})


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize("rows,fmt", [
    ([{"prompt": "p", "completion": "c"}], formats.PROMPT_COMPLETION),
    ([{"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]}], formats.MESSAGES),
    ([{"text": "t"}], formats.TEXT),
])
def test_the_format_comes_from_the_columns_as_trl_decides(tmp_path, rows, fmt):
    assert check_input(cfg(write_jsonl(tmp_path / "d.jsonl", rows))) == fmt
    assert check_input(cfg("bbcnews-headlines")) == formats.PROMPT_COMPLETION


def test_a_csv_without_its_label_column_is_named_from_the_header(tmp_path):
    (tmp_path / "d.csv").write_text("text,topic\n" + "a,b\n" * 1000)
    with pytest.raises(DataError, match=r"data.label_column='label' is not a column of .*d.csv \(columns: text, topic\)"):
        check_input(cfg(str(tmp_path / "d.csv"), "sequence-classification"))


def test_a_csv_without_its_label_column_exits_2_in_seconds_with_nothing_left(tmp_path):
    """Issue 20 item 4: `onegpu inputs` (the pipeline's first stage) says it before any heavy import."""
    import yaml

    from tests import defaults
    (tmp_path / "d.csv").write_text("text,topic\n" + "some words,b\n" * 2000)
    params = defaults.params()
    params["data"]["source"] = "d.csv"
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "onegpu", "inputs"], cwd=tmp_path, capture_output=True, text=True)
    seconds = time.perf_counter() - t
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == ("onegpu inputs: error: data.label_column='label' is not a column of d.csv "
                                   "(columns: text, topic)")
    assert seconds < 5, seconds
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.csv", "params.yaml"]  # no .onegpu, mlflow.db, data/


@pytest.mark.parametrize("key,rows,message", [
    ("completion_only_loss", [{"text": "t"}], "data.completion_only_loss is true, but .* is text data"),
    ("assistant_only_loss", [{"prompt": "p", "completion": "c"}], "data.assistant_only_loss is true, but .* is prompt-completion"),
])
def test_answer_only_losses_need_their_format(tmp_path, key, rows, message):
    with pytest.raises(DataError, match=message):
        check_input(cfg(write_jsonl(tmp_path / "d.jsonl", rows), **{key: True}))


ALLOWED = 'not a list of {"role": ..., "content": ...} objects'


def test_a_messages_cell_that_is_not_a_list_of_turns_names_its_row(tmp_path):
    good = {"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]}
    path = write_jsonl(tmp_path / "d.jsonl", [good, good, {"messages": "just text"}])
    check_input(cfg(path))  # the first record is fine: the cheap check passes
    with pytest.raises(DataError) as e:  # a JSON string is a string, not "not JSON" (issue 34)
        instructions.read(cfg(path).data)
    assert str(e.value) == f"data.source={path!r}: line 3: the messages cell is a string ('just text'), {ALLOWED}"
    with pytest.raises(DataError, match=r"line 1: the messages cell is a string \('just text'\), not a list"):
        check_input(cfg(write_jsonl(tmp_path / "s.jsonl", [{"messages": "just text"}])))
    path = write_jsonl(tmp_path / "e.jsonl", [{"messages": [{"role": "user", "text": "u"}]}])
    with pytest.raises(DataError, match=r"line 1: messages\[0\] has keys \['role', 'text'\]"):
        check_input(cfg(path))


def test_a_csv_messages_cell_is_json_text(tmp_path):
    turns = '"[{""role"": ""user"", ""content"": ""u""}, {""role"": ""assistant"", ""content"": ""a""}]"'
    (tmp_path / "d.csv").write_text(f"messages\n{turns}\n")
    assert instructions.read(cfg(str(tmp_path / "d.csv")).data).rows == [
        {"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]}]
    (tmp_path / "e.csv").write_text(f"messages\n{turns}\njust text\n")
    with pytest.raises(DataError, match=r"row 2: the messages cell is not JSON; a CSV cell of messages must be the "
                                        r"JSON text of a list of \{"):
        instructions.read(cfg(str(tmp_path / "e.csv")).data)
    (tmp_path / "f.csv").write_text('messages\n"""just text"""\n')  # JSON text of a string
    with pytest.raises(DataError, match=r"row 1: the messages cell is a string \('just text'\), not a list"):
        instructions.read(cfg(str(tmp_path / "f.csv")).data)


def test_a_file_whose_completions_are_all_empty_names_prompt_and_completion(tmp_path):
    from onegpu.data import pipeline
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"question {i}", "completion": " "} for i in range(3)])
    with pytest.raises(DataError) as e:
        pipeline.prepare(cfg(path), check_input(cfg(path)), make_tokenizer=None)
    assert str(e.value) == (f"data.source={path!r}: no row has a non-blank prompt and a non-blank completion "
                            "(3 rows read, 3 dropped (empty completion 3))")
    path = write_jsonl(tmp_path / "m.jsonl", [{"messages": []}] * 2)
    with pytest.raises(DataError, match=r"no row has a non-empty messages list of role/content turns \(2 rows read, "
                                        r"2 dropped \(empty messages 2\)\)"):
        pipeline.prepare(cfg(path), formats.MESSAGES, make_tokenizer=None)


def test_messages_without_an_assistant_turn_under_assistant_only_loss(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": [{"role": "user", "content": "u"},
                                                            {"role": "assistant", "content": "a"}]},
                                              {"messages": [{"role": "user", "content": "only a question"}]}])
    with pytest.raises(DataError, match="line 2 has no assistant turn"):
        instructions.read(cfg(path, assistant_only_loss=True).data)


def test_parquet_and_csv_instruction_tables_read_the_same_rows(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    rows = [{"prompt": f"question {i}", "completion": f"answer {i}"} for i in range(3)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    (tmp_path / "d.csv").write_text("prompt,completion\n" + "".join(f"question {i},answer {i}\n" for i in range(3)))
    for name in ("d.parquet", "d.csv"):
        data = instructions.read(cfg(str(tmp_path / name)).data)
        assert data.format == formats.PROMPT_COMPLETION and data.rows == rows


def test_headlines_are_the_first_line_of_each_article():
    data = instructions.read_headlines()
    assert len(data.rows) == 2225 and set(data.labels) == {"business", "entertainment", "politics", "sports", "tech"}
    first = data.rows[0]
    assert first["prompt"].startswith(instructions.HEADLINE_INSTRUCTION) and "\n" not in first["completion"]
    rows, _, dropped = instructions.deduplicate(data)
    assert dropped["duplicate"] == 98 and len(rows) == 2127
