"""Instruction rows as tokens (onegpu.data.chat): the exact rendered strings, the loss masks, truncation
of the prompt (never the answer), the drops, and a messages answer's ids after exactly the generation
prompt's whatever the answer opens with, with the packaged SmolLM2 tokenizer's chat template."""
from __future__ import annotations

import pytest

from onegpu.data import chat
from onegpu.errors import DataError

SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"


@pytest.fixture(scope="module")
def tok():
    from tests.unit.training.objectives import test_batches as tp
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


# Issue 34: an answer opening with whitespace. SmolLM2's tokenizer merges the template's "\n" after
# "assistant" with the answer's leading whitespace into one token ("assistant\n" + "\n\nRates" rendered
# together gives "ĊĊ" 1116, "Ċ" 198 where the generation prompt ends in "Ċ" 198); a row tokenized as one
# text then had a token that was neither prompt nor target.
OPENINGS = {"newline": "\n    return rates", "blank-line": "\n\nRates rise.", "two-spaces": "  return rates",
            "tab": "\t\treturn rates", "code-fence": "```python\nrates = 1\n```", "text": "Rates rise.",
            "only-newline": "\n", "only-tab": "\t"}
QUESTION = [{"role": "user", "content": "Write the headline."}]
GENERATION_PROMPT_END = [1, 520, 9531, 198]  # "<|im_start|>", "ass", "istant", "Ċ": the generation prompt's last ids


def _generation_prompt_ids(tok, msgs) -> list[int]:
    return tok(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
               add_special_tokens=False)["input_ids"]


def _turn_ids(tok, answer: str) -> list[int]:
    """The answer's own tokens: its text and the end of its turn, tokenized alone."""
    return tok(answer + "<|im_end|>\n", add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("assistant_only", [True, False], ids=["assistant_only_loss", "every-token"])
@pytest.mark.parametrize("answer", OPENINGS.values(), ids=OPENINGS.keys())
def test_a_messages_answer_is_all_targets_after_exactly_the_generation_prompt(tok, answer, assistant_only):
    row = chat.messages(tok, QUESTION + [{"role": "assistant", "content": answer}], 200, assistant_only)
    prompt, turn = _generation_prompt_ids(tok, QUESTION), _turn_ids(tok, answer)
    assert prompt[-4:] == GENERATION_PROMPT_END and row["prompt_length"] == len(prompt) == 34
    assert row["input_ids"] == prompt + turn  # what evaluation generates after, then the answer's own ids
    targets = [t for t in row["labels"] if t != -100]
    assert len(targets) == (len(turn) if assistant_only else len(prompt) + len(turn))
    assert targets[-len(turn):] == turn and targets[-2:] == [tok.eos_token_id, 198]
    assert row["labels"][:len(prompt)] == ([-100] * len(prompt) if assistant_only else prompt)


def test_each_assistant_turn_is_its_own_tokens_in_a_conversation(tok):
    first, second = "\n\nRates rise.", "  return rates"
    msgs = QUESTION + [{"role": "assistant", "content": first}, {"role": "user", "content": "And the code?"},
                       {"role": "assistant", "content": second}]
    row = chat.messages(tok, msgs, 200, True)
    assert [t for t in row["labels"] if t != -100] == _turn_ids(tok, first) + _turn_ids(tok, second)
    prompt = row["input_ids"][:row["prompt_length"]]
    assert tok.decode(prompt) == tok.apply_chat_template(msgs[:3], tokenize=False, add_generation_prompt=True)
    assert prompt[-4:] == GENERATION_PROMPT_END and row["input_ids"][row["prompt_length"]:] == _turn_ids(tok, second)


def test_messages_with_ordinary_answers_keep_the_ids_of_the_whole_conversation(tok):
    msgs = QUESTION + [{"role": "assistant", "content": "Rates rise."}, {"role": "user", "content": "Shorter?"},
                       {"role": "assistant", "content": " Rates up"}, {"role": "user", "content": "\n\nThanks"}]
    whole = tok(tok.apply_chat_template(msgs, tokenize=False), add_special_tokens=False)["input_ids"]
    every, answers = chat.messages(tok, msgs, 200, False), chat.messages(tok, msgs, 200, True)
    assert every["input_ids"] == every["labels"] == answers["input_ids"] == whole
    targets = [t for t in answers["labels"] if t != -100]
    assert targets == _turn_ids(tok, "Rates rise.") + _turn_ids(tok, " Rates up")
    assert every["prompt_length"] == answers["prompt_length"] == len(_generation_prompt_ids(tok, msgs[:3])) == 53


@pytest.mark.parametrize("assistant_only,key,fix", [(True, "data.assistant_only_loss", "set it to false"),
                                                    (False, "messages data", "use prompt-completion data")])
def test_a_template_that_does_not_render_turns_one_after_another_is_refused(tok, monkeypatch, assistant_only, key,
                                                                            fix):
    monkeypatch.setattr(tok, "chat_template", "{% for m in messages %}{% if loop.last %}Last: {% endif %}"
                                              "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    msgs = QUESTION + [{"role": "assistant", "content": "Rates rise."}, {"role": "user", "content": "Shorter?"}]
    with pytest.raises(DataError) as e:
        chat.messages(tok, msgs, 200, assistant_only)
    assert str(e.value) == (f"{key}: the chat template does not render a conversation as its turns one after "
                            f"another, so the assistant turns cannot be found; {fix}")


def test_ignore_index_is_defined_once_in_data_and_training_uses_it():
    """The labels' "no target" value: data makes the labels, training/ imports it (issue 31)."""
    from pathlib import Path

    import onegpu
    from onegpu.training.objectives import batches, loss
    src = Path(onegpu.__file__).parent
    defined = sorted(str(p.relative_to(src)) for p in src.rglob("*.py") if "IGNORE_INDEX = " in p.read_text())
    assert defined == ["data/chat.py"]
    assert loss.IGNORE_INDEX is batches.IGNORE_INDEX is chat.IGNORE_INDEX == -100
