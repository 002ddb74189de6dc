"""The data's form checked first (onegpu.data.check.check_input): one line naming the problem, before any
heavy import."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from onegpu.data import check_input, formats
from onegpu.errors import DataError
from tests.unit.data.rows import cfg, write_jsonl


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
    with pytest.raises(DataError, match=r"data.label_column='label' is not a column of .*d.csv "
                                        r"\(columns: text, topic\)"):
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
    ("assistant_only_loss", [{"prompt": "p", "completion": "c"}],
     "data.assistant_only_loss is true, but .* is prompt-completion"),
])
def test_answer_only_losses_need_their_format(tmp_path, key, rows, message):
    with pytest.raises(DataError, match=message):
        check_input(cfg(write_jsonl(tmp_path / "d.jsonl", rows), **{key: True}))
