"""Prompts with a verifiable answer (onegpu.data.prompt_answer): the packaged sections set derived from the
corpus alone, table cells read as TRL's prompt-only rows with an answer, drops counted, bad cells one line
naming the row, prompts tokenized as the model generates from them and cut to data.max_length."""
from __future__ import annotations

import pytest

from onegpu.data import prompt_answer
from onegpu.errors import DataError
from onegpu.training.objectives import rewards
from tests.unit.data.rows import cfg, write_jsonl

SECTIONS = {"business", "entertainment", "politics", "sports", "tech"}


def test_the_packaged_sections_are_the_corpus_articles_with_their_section_as_answer():
    rows = prompt_answer.sections()
    again = prompt_answer.sections()
    assert len(rows) == 2225 and rows.columns == again.columns  # every article, nothing random
    assert set(rows.columns["answer"]) == SECTIONS and rows.columns["answer"] == rows.labels
    first = rows.records()[0]
    assert first["prompt"].startswith(prompt_answer.SECTIONS_INSTRUCTION + "Ad sales boost Time Warner profit\n\n"
                                      "Quarterly profits at US media giant TimeWarner jumped 76%")
    assert "\n\n" not in first["prompt"][len(prompt_answer.SECTIONS_INSTRUCTION) + 40:]  # one paragraph only
    assert first["answer"] == "business"
    # the built-in reward reads the answer the instruction asks for
    assert rewards.correctness([first["prompt"]] * 2, ["It is <answer> Business </answer>", "<answer>tech</answer>"],
                               answer=["business"] * 2) == [1.0, 0.0]


def test_table_cells_read_as_prompt_only_rows_with_an_answer(tmp_path):
    sky = [{"role": "user", "content": "What is 2 + 3?"}]
    rows = [{"prompt": " Q: 7 x 6? ", "answer": 42}, {"prompt": sky, "answer": " 5 "}, {"prompt": "Q: pi?", "answer": 3.14},
            {"prompt": "", "answer": "1"}, {"prompt": "Q: none?"}, {"prompt": " Q: 7 x 6? ", "answer": "42"}]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    reader = prompt_answer.READER
    got = reader.read(cfg(path))
    assert got.records()[:3] == [{"prompt": "Q: 7 x 6?", "answer": "42"}, {"prompt": sky, "answer": "5"},
                                 {"prompt": "Q: pi?", "answer": "3.14"}]
    kept, dropped = reader.deduplicate(got)
    assert len(kept) == 3 and dropped == {"empty_prompt": 1, "empty_answer": 1, "duplicate": 1, "prompt_too_long": 0}


@pytest.mark.parametrize(("row", "message"), [
    ({"prompt": "Q", "answer": {"x": 1}}, "line 1: the answer cell is a dict; it must be a string or a number"),
    ({"prompt": "Q", "answer": True}, "line 1: the answer cell is a bool"),
    ({"prompt": 7, "answer": "1"}, "line 1: the prompt cell is a int; it must be a string or a list of"),
    ({"prompt": [{"role": "judge", "content": "x"}], "answer": "1"}, "prompt[0] has role 'judge'"),
])
def test_a_bad_cell_is_one_line_naming_the_row(tmp_path, row, message):
    path = write_jsonl(tmp_path / "p.jsonl", [row])
    with pytest.raises(DataError, match=message.replace("[", r"\[").replace("]", r"\]")):
        prompt_answer.READER.read(cfg(path))


def test_prompts_render_with_the_generation_prompt_and_are_cut_to_fit():
    from tests.unit.training.objectives.test_batches import tokenizer
    tok = tokenizer()
    ids, truncated = prompt_answer.prompt_ids(tok, "What is 2 + 3?", 64)
    text = tok.decode(ids)
    assert not truncated and text.endswith("What is 2 + 3?<|im_end|>\n<|im_start|>assistant\n")
    assert ids == tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False)
    long = "word " * 200
    full, _ = prompt_answer.prompt_ids(tok, long, 10_000)
    cut, truncated = prompt_answer.prompt_ids(tok, long, len(full) - 50)
    assert truncated and len(cut) <= len(full) - 50 and tok.decode(cut).endswith("<|im_start|>assistant\n")
    assert prompt_answer.prompt_ids(tok, "Hi", 3) is None  # the template alone is longer: nothing left to cut


def test_tokenize_keeps_the_answer_and_counts_the_prompts_that_cannot_fit():
    from datasets import Dataset, DatasetDict

    from onegpu.config import from_container
    from tests.unit.training.objectives.test_batches import tokenizer
    tok = tokenizer()
    split = {"prompt": ["What is 2 + 3?", "What is 7 x 6?", "x"],
             "answer": ["5", "42", "1"], "label": ["text"] * 3}
    dsd = DatasetDict({"train": Dataset.from_dict(split), "test": Dataset.from_dict(split)})
    shortest = len(prompt_answer.prompt_ids(tok, "x", 100)[0])
    c = from_container({"data": {"source": "x.jsonl", "max_length": shortest + 2},
                        "model": {"task": "causal-lm", "name_or_path": None}})
    out, dropped, truncated = prompt_answer.READER.tokenize(dsd, tok, c)
    assert dropped == {"prompt_too_long": 0} and truncated == 4  # both questions cut, in 2 splits
    assert out["train"]["answer"] == ["5", "42", "1"] and max(out["train"]["length"]) <= shortest + 2
    c = from_container({"data": {"source": "x.jsonl", "max_length": 8},  # under the template alone
                        "model": {"task": "causal-lm", "name_or_path": None}})
    with pytest.raises(DataError, match="no train prompt fits data.max_length"):
        prompt_answer.READER.tokenize(dsd, tok, c)
