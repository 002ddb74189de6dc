"""Instruction rows as tokens (onegpu.data.chat): the exact rendered strings, the loss masks, truncation
of the prompt (never the answer), and the drops, with the packaged SmolLM2 tokenizer's chat template."""
from __future__ import annotations

import pytest

from onegpu.data import chat
from onegpu.errors import DataError

SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"


@pytest.fixture(scope="module")
def tok():
    from tests.unit import test_padding_free as tp
    return tp.tokenizer()


def test_a_prompt_completion_row_is_rendered_with_the_chat_template(tok):
    p, c = chat.render(tok, "Write the headline.\n\nRates rose.", "Rates rise")
    assert p == SYSTEM + "<|im_start|>user\nWrite the headline.\n\nRates rose.<|im_end|>\n<|im_start|>assistant\n"
    assert c == "Rates rise<|im_end|>\n"


def test_without_a_template_the_row_is_a_plain_join_with_eos(tok, monkeypatch):
    monkeypatch.setattr(tok, "chat_template", None)
    assert chat.render(tok, "Article text", "Headline") == ("Article text\n", "Headline<|im_end|>")
    assert chat.render(tok, "Article text\n", "Headline") == ("Article text\n", "Headline<|im_end|>")
    with pytest.raises(DataError, match="no chat template"):
        chat.render(tok, [{"role": "user", "content": "hi"}], "x")


def test_completion_only_masks_the_prompt_and_keeps_the_end_of_answer(tok):
    row = chat.prompt_completion(tok, "Write the headline.\n\nRates rose.", "Rates rise", 128, True)
    targets = [t for t in row["labels"] if t != -100]
    assert tok.decode(targets) == "Rates rise<|im_end|>\n" and tok.eos_token_id in targets
    assert row["labels"][:row["prompt_length"]] == [-100] * row["prompt_length"]
    every = chat.prompt_completion(tok, "Write the headline.\n\nRates rose.", "Rates rise", 128, False)
    assert every["labels"] == every["input_ids"] == row["input_ids"]


def test_a_long_prompt_is_cut_never_the_answer(tok):
    body = "The bank raised rates again today. " * 60
    row = chat.prompt_completion(tok, "Write the headline.\n\n" + body, "Bank raises rates", 64, True)
    assert len(row["input_ids"]) <= 64 and row["truncated"]
    text = tok.decode(row["input_ids"])
    assert text.startswith(SYSTEM + "<|im_start|>user\nWrite the headline.\n\nThe bank raised rates")
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\nBank raises rates<|im_end|>\n")
    # an answer that cannot fit even after an empty prompt: the row is dropped (None), not cut
    assert chat.prompt_completion(tok, "x", "word " * 80, 64, True) is None


def test_assistant_only_loss_keeps_each_assistant_turn(tok):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"},
            {"role": "user", "content": "bye"}, {"role": "assistant", "content": "ciao"}]
    row = chat.messages(tok, msgs, 200, True)
    assert tok.decode([t for t in row["labels"] if t != -100]) == "hello there<|im_end|>\nciao<|im_end|>\n"
    assert tok.decode(row["input_ids"][:row["prompt_length"]]).endswith("bye<|im_end|>\n<|im_start|>assistant\n")
    assert all(t != -100 for t in chat.messages(tok, msgs, 200, False)["labels"])
    # cut before any assistant token: no target left, the row is dropped
    assert chat.messages(tok, msgs, 20, True) is None


def test_messages_need_a_chat_template(tok, monkeypatch):
    monkeypatch.setattr(tok, "chat_template", None)
    with pytest.raises(DataError, match="messages .* no chat template"):
        chat.messages(tok, [{"role": "user", "content": "hi"}], 64, False)
