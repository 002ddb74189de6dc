"""Preference data (onegpu.data.preference): explicit and implicit prompts read as TRL reads them, the
packaged headline pairs, tokenization as TRL does it but refusing a prompt that is not a prefix, drops
counted, bad cells one line naming the row."""
from __future__ import annotations

import json

import pytest

from onegpu.data import check_input, formats, preference, readers
from onegpu.errors import DataError
from tests.unit.data.rows import cfg, write_jsonl

torch = pytest.importorskip("torch")


def _cfg(source: str, **data):
    from onegpu.config import from_container
    return from_container({"data": {"source": source, **data}, "model": {"task": "preference", "name_or_path": None}})


def chat_tokenizer():
    from tests.unit.training.objectives.test_batches import tokenizer
    return tokenizer()


def test_explicit_and_implicit_prompts_read_as_trl_reads_them(tmp_path):
    """A prompt column is kept; without one the prompt is the answers' common prefix (messages or text),
    as ``trl.data_utils.maybe_extract_prompt`` splits it."""
    sky = [{"role": "user", "content": "What color is the sky?"}]
    rows = [{"prompt": "Q: sky?", "chosen": " blue", "rejected": " green"},
            {"chosen": sky + [{"role": "assistant", "content": "Blue."}],
             "rejected": sky + [{"role": "assistant", "content": "Green."}]},
            {"chosen": "Q: sea? A: blue", "rejected": "Q: sea? A: red"}]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    assert check_input(_cfg(path)) == formats.PREFERENCE
    got = readers.reader(formats.PREFERENCE).read(_cfg(path)).records()
    assert got[0] == rows[0]
    assert got[1] == {"prompt": sky, "chosen": [{"role": "assistant", "content": "Blue."}],
                      "rejected": [{"role": "assistant", "content": "Green."}]}
    assert got[2] == {"prompt": "Q: sea? A:", "chosen": " blue", "rejected": " red"}  # TRL's space rule


def test_the_packaged_pairs_are_hard_deterministic_and_deduplicated():
    """chosen = the article's headline, rejected = another headline of the same topic; the corpus's 98
    repeated articles make repeated pairs (the choice is seeded by the article), dropped as duplicates."""
    from onegpu.data import prompt_completion
    pairs = preference.headline_pairs()
    heads = prompt_completion.headlines()
    assert len(pairs) == 2225 and pairs.columns["chosen"] == heads.columns["completion"]
    topic_of = {}
    for h, t in zip(heads.columns["completion"], heads.labels):
        topic_of.setdefault(h, set()).add(t)
    for r, topic in zip(pairs.records(), pairs.labels):
        assert r["rejected"] != r["chosen"] and topic in topic_of[r["rejected"]]
    assert preference.headline_pairs().records() == pairs.records()
    kept, dropped = preference.READER.deduplicate(pairs)
    assert dropped["duplicate"] == 98 and len(kept) == 2127 and sum(dropped.values()) == 98


def test_empty_sides_and_identical_answers_are_dropped_and_counted(tmp_path):
    rows = [{"prompt": "p0", "chosen": "a", "rejected": "b"}, {"prompt": " ", "chosen": "a", "rejected": "b"},
            {"prompt": "p2", "chosen": "", "rejected": "b"}, {"prompt": "p3", "chosen": "a", "rejected": None},
            {"prompt": "p4", "chosen": "same", "rejected": "same"}, {"prompt": "p0", "chosen": "a", "rejected": "b"}]
    data = preference.READER.read(_cfg(write_jsonl(tmp_path / "p.jsonl", rows)))
    kept, dropped = preference.READER.deduplicate(data)
    assert len(kept) == 1 and dropped == {"empty_prompt": 1, "empty_chosen": 1, "empty_rejected": 1,
                                          "identical_answers": 1, "duplicate": 1, "answer_too_long": 0}


@pytest.mark.parametrize("row, names", [
    ({"prompt": "p", "chosen": 7, "rejected": "b"}, ["line 2", "the chosen cell is a int"]),
    ({"prompt": "p", "chosen": "a", "rejected": [{"role": "user"}]}, ["line 2", "rejected[0] has keys ['role']"]),
    ({"prompt": "p", "chosen": "a", "rejected": [{"role": "assistant", "content": "b"}]},
     ["line 2", "chosen is a str and rejected a list"]),
])
def test_a_bad_cell_is_one_line_naming_its_row(tmp_path, row, names):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "q", "chosen": "a", "rejected": "b"}, row])
    with pytest.raises(DataError) as e:
        preference.READER.read(_cfg(path))
    assert "\n" not in str(e.value) and all(n in str(e.value) for n in names), str(e.value)


def test_missing_columns_and_the_wrong_task_fail_before_any_work(tmp_path):
    half = write_jsonl(tmp_path / "half.jsonl", [{"prompt": "q", "chosen": "a"}])
    with pytest.raises(DataError, match="needs chosen and rejected columns"):
        check_input(_cfg(half))
    pairs = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "q", "chosen": "a", "rejected": "b"}])
    with pytest.raises(DataError, match="is preference data .* but model.task is causal-lm"):
        check_input(cfg(pairs))


def test_pairs_tokenize_as_trl_prompt_then_each_answer_with_masks_from_lengths():
    """Both sequences start with the prompt's ids (with the generation prompt); each answer is what follows,
    its end of turn included (SmolLM2's pad = eos = <|im_end|>: a target, found by length, not id)."""
    tok = chat_tokenizer()
    out = preference.pair(tok, "Write a headline.", "Rates cut", "Team wins", 64)
    p = tok.apply_chat_template([{"role": "user", "content": "Write a headline."}], tokenize=False,
                                add_generation_prompt=True)
    assert tok.decode(out["prompt_ids"]) == p and not out["truncated"]
    assert tok.decode(out["chosen_ids"]) == "Rates cut<|im_end|>\n"
    assert tok.decode(out["rejected_ids"]) == "Team wins<|im_end|>\n"


def test_a_long_prompt_is_cut_never_an_answer_and_a_pair_that_cannot_fit_is_dropped():
    tok = chat_tokenizer()
    long = "Write a headline. " + "the market rose again " * 40
    out = preference.pair(tok, long, "Rates cut", "Team wins today after all", 48)
    assert out["truncated"] and len(out["prompt_ids"]) + len(out["rejected_ids"]) <= 48
    assert tok.decode(out["rejected_ids"]) == "Team wins today after all<|im_end|>\n"
    assert preference.pair(tok, "Write.", "word " * 60, "b", 48) is None


def test_a_prompt_rendered_otherwise_before_an_answer_is_refused_with_its_row():
    """A template that ends the generation prompt with a block the full conversation drops (as Gemma's
    empty thought block): TRL warns once and trains the answer after another context; onegpu refuses."""
    from datasets import ClassLabel, Dataset, DatasetDict
    tok = chat_tokenizer()
    tok = tok.__class__.from_pretrained(tok.name_or_path)
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n<think></think>{% endif %}")
    ds = Dataset.from_dict({"prompt": ["Write a headline."], "chosen": ["a"], "rejected": ["b"], "label": ["x"]})
    ds = ds.cast_column("label", ClassLabel(names=["x"]))
    with pytest.raises(DataError) as e:
        preference.tokenize_pairs(DatasetDict(train=ds), tok, 64)
    msg = str(e.value)
    assert "train row 0 (prompt 'Write a headline.')" in msg and "<think>" in msg and "\n" not in msg


def test_prepare_counts_pairs_dropped_by_truncation(tmp_path):
    """Rows whose answer cannot fit are counted under answer_too_long; a split left empty fails in one line."""
    from datasets import ClassLabel, Dataset, DatasetDict
    tok = chat_tokenizer()
    rows = {"prompt": [f"Q {i}" for i in range(4)], "chosen": ["short", "word " * 80, "ok", "fine"],
            "rejected": ["b", "c", "d", "e"], "label": ["x"] * 4}
    ds = Dataset.from_dict(rows).cast_column("label", ClassLabel(names=["x"]))
    out, dropped, truncated = preference.tokenize_pairs(DatasetDict(train=ds), tok, 64)
    assert (len(out["train"]), dropped, truncated) == (3, 1, 0)
    assert set(out["train"].column_names) >= {"prompt_ids", "chosen_ids", "rejected_ids", "length", "label"}
    with pytest.raises(DataError, match="no train pair fits data.max_length=16"):  # (the system turn alone is more)
        preference.tokenize_pairs(DatasetDict(train=ds), tok, 16)


def test_a_csv_of_strings_reads_like_json_lines(tmp_path):
    rows = [{"prompt": f"q {i}", "chosen": f"good {i}", "rejected": f"bad {i}"} for i in range(3)]
    (tmp_path / "p.csv").write_text("prompt,chosen,rejected\n" + "".join(
        f"{r['prompt']},{r['chosen']},{r['rejected']}\n" for r in rows))
    assert preference.READER.read(_cfg(str(tmp_path / "p.csv"))).records() == rows
    assert json.loads(preference.READER.key(rows[0])) == rows[0]
