"""Messages data (onegpu.data.messages): each cell checked row by row, the row named in the one line."""
from __future__ import annotations

import pytest

from onegpu.data import check_input, messages
from onegpu.errors import DataError
from tests.unit.data.rows import cfg, write_jsonl

ALLOWED = 'not a list of {"role": ..., "content": ...} objects'


def test_a_messages_cell_that_is_not_a_list_of_turns_names_its_row(tmp_path):
    good = {"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]}
    path = write_jsonl(tmp_path / "d.jsonl", [good, good, {"messages": "just text"}])
    check_input(cfg(path))  # the first record is fine: the cheap check passes
    with pytest.raises(DataError) as e:  # a JSON string is a string, not "not JSON" (issue 34)
        messages.READER.read(cfg(path))
    assert str(e.value) == f"data.source={path!r}: line 3: the messages cell is a string ('just text'), {ALLOWED}"
    with pytest.raises(DataError, match=r"line 1: the messages cell is a string \('just text'\), not a list"):
        check_input(cfg(write_jsonl(tmp_path / "s.jsonl", [{"messages": "just text"}])))
    path = write_jsonl(tmp_path / "e.jsonl", [{"messages": [{"role": "user", "text": "u"}]}])
    with pytest.raises(DataError, match=r"line 1: messages\[0\] has keys \['role', 'text'\]"):
        check_input(cfg(path))


def test_a_csv_messages_cell_is_json_text(tmp_path):
    turns = '"[{""role"": ""user"", ""content"": ""u""}, {""role"": ""assistant"", ""content"": ""a""}]"'
    (tmp_path / "d.csv").write_text(f"messages\n{turns}\n")
    assert messages.READER.read(cfg(str(tmp_path / "d.csv"))).records() == [
        {"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]}]
    (tmp_path / "e.csv").write_text(f"messages\n{turns}\njust text\n")
    with pytest.raises(DataError, match=r"row 2: the messages cell is not JSON; a CSV cell of messages must be the "
                                        r"JSON text of a list of \{"):
        messages.READER.read(cfg(str(tmp_path / "e.csv")))
    (tmp_path / "f.csv").write_text('messages\n"""just text"""\n')  # JSON text of a string
    with pytest.raises(DataError, match=r"row 1: the messages cell is a string \('just text'\), not a list"):
        messages.READER.read(cfg(str(tmp_path / "f.csv")))


def test_messages_without_an_assistant_turn_under_assistant_only_loss(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": [{"role": "user", "content": "u"},
                                                            {"role": "assistant", "content": "a"}]},
                                              {"messages": [{"role": "user", "content": "only a question"}]}])
    with pytest.raises(DataError, match="line 2 has no assistant turn"):
        messages.READER.read(cfg(path, assistant_only_loss=True))


def test_messages_and_a_tokenizer_without_a_chat_template_is_one_line_before_any_row(monkeypatch):
    from datasets import DatasetDict

    from onegpu.data import splits
    from tests.unit.training.objectives import test_batches as tp
    tok = tp.tokenizer()
    monkeypatch.setattr(tok, "chat_template", None)
    msgs = [[{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]]
    dsd = DatasetDict(train=splits.dataset({"messages": msgs}, ["text"], ["text"]))
    with pytest.raises(DataError, match=r"the data is messages \(role/content turns\) but the tokenizer has no chat "
                                        "template"):
        messages.READER.tokenize(dsd, tok, cfg("d.jsonl", max_length=64))
