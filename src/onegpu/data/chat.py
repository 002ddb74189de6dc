"""Instruction rows as token ids with their loss mask: the chat template, the answer-only losses, truncation.

**Rendering.** Where the tokenizer has a chat template, a prompt-completion row is rendered as TRL does
(``trl.data_utils.apply_chat_template``): the prompt (a string becomes one user turn) with the generation
prompt, and prompt + completion (a string becomes one assistant turn); the completion is what follows the
two renderings' common prefix. Without a template the row is a plain join: ``prompt`` (+ ``"\\n"`` when it
does not end in whitespace) then ``completion`` + the EOS token. ``messages`` rows need a template.

**Token ids.** The prompt and the completion text are tokenized separately and concatenated, so a
training sequence starts with exactly the ids the model gets at generation time for that prompt. A
``messages`` row likewise: each assistant turn and the text before it (up to the end of the template's
generation prompt) are tokenized apart and joined, so an answer opening with whitespace (``"\\n\\n"``, two
spaces) is not merged with the ``\\n`` after ``assistant`` into one token that is neither prompt nor target.

**The loss mask** (labels = ids, -100 where masked; :mod:`onegpu.training.objectives.loss` shifts them):
``data.completion_only_loss`` (null = on for prompt-completion rows) masks the prompt; the completion,
its end-of-turn token (here pad = eos = ``<|im_end|>``) included, stays a target: masking is by position,
never by token id. ``data.assistant_only_loss`` keeps only the assistant turns of ``messages`` rows, found
by rendering the conversation turn by turn, in text, before tokenizing (the template's own
``{% generation %}`` markers are not needed, SmolLM2's template has none); a template that does not render
a conversation as the concatenation of its turns is refused.

**Truncation** to ``data.max_length`` cuts the prompt, never the answer: the last prompt message's text is
shortened (by tokens, from its end) until the whole sequence fits. A row whose completion does not fit
even with an empty prompt is dropped and counted (``completion_too_long``). ``messages`` rows are cut at
``data.max_length`` from the end (TRL's ``keep_start``); one left with no target token is dropped and
counted (``no_target_after_truncation``).
"""
from __future__ import annotations

from onegpu.data import formats
from onegpu.errors import DataError

IGNORE_INDEX = -100  # the label of a position without a target (the loss skips it): defined here only


def has_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def token_ids(tokenizer, text: str) -> list[int]:
    """``text``'s token ids, no special token added."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def render(tokenizer, prompt, completion, strict: bool = False) -> tuple[str, str]:
    """``(prompt text, completion text)`` as the model sees them (see the module docstring).

    ``strict``: the prompt rendered alone (with the generation prompt) must be a prefix of the rendering of
    prompt + completion, so the answer follows the very context the model generates it from (preference
    data: TRL only warns, and trains the answer after a context the model never sees).

    Raises:
        DataError: conversational cells and a tokenizer without a chat template; under ``strict``, a prompt
            rendered alone that is not a prefix of prompt + completion (the message quotes where they part).
    """
    if has_template(tokenizer):
        p = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        c = completion if isinstance(completion, list) else [{"role": "assistant", "content": completion}]
        alone = tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True)
        full = tokenizer.apply_chat_template(p + c, tokenize=False)
        cut = _common_prefix(alone, full)  # TRL's rule: the completion starts where the two renderings part
        if strict and cut < len(alone):
            raise DataError(f"the chat template renders this prompt alone as ...{alone[max(cut - 20, 0):cut + 20]!r} "
                            f"but followed by its answer as ...{full[max(cut - 20, 0):cut + 20]!r}: the answer would "
                            "be trained after a context the model never generates from; fix the template or the row")
        return full[:cut], full[cut:]
    if isinstance(prompt, list) or isinstance(completion, list):
        raise DataError("the data has conversational (role/content) cells but the tokenizer has no chat template: "
                        "use a model whose tokenizer has one (e.g. packaged:SmolLM2-135M-Instruct), or plain strings")
    sep = "" if not prompt or prompt[-1].isspace() else "\n"
    return prompt + sep, completion + (tokenizer.eos_token or "")


def last_text(value) -> str:
    """The text of a prompt or completion in either of TRL's forms: a string as it is, a conversational one's
    last message's ``content``."""
    return value[-1]["content"] if isinstance(value, list) else value


def shortened(prompt, tokenizer, over: int):
    """``prompt`` with its last message's text (or the string itself) ``over`` tokens shorter; None when
    nothing is left to cut."""
    ids = token_ids(tokenizer, last_text(prompt))
    if not ids:
        return None
    cut = tokenizer.decode(ids[:max(len(ids) - over, 0)])
    return prompt[:-1] + [{**prompt[-1], "content": cut}] if isinstance(prompt, list) else cut


def prompt_completion(tokenizer, prompt, completion, max_length: int,
                      completion_only: bool) -> dict | None:
    """One prompt-completion row as ``input_ids``, ``labels``, ``prompt_length`` (tokens before the
    completion) and ``truncated`` (the prompt was cut), at most ``max_length`` tokens; None when the
    completion does not fit even with an empty prompt (see the module docstring)."""
    truncated = False
    for _ in range(8):  # each round cuts what is still over; decoding and re-encoding may shift a token
        p_text, c_text = render(tokenizer, prompt, completion)
        p_ids, c_ids = token_ids(tokenizer, p_text), token_ids(tokenizer, c_text)
        over = len(p_ids) + len(c_ids) - max_length
        if over <= 0:
            ids = p_ids + c_ids
            labels = [IGNORE_INDEX] * len(p_ids) + c_ids if completion_only else list(ids)
            return {"input_ids": ids, "labels": labels, "prompt_length": len(p_ids), "truncated": truncated}
        prompt = shortened(prompt, tokenizer, over)
        truncated = True
        if prompt is None:
            return None
    return None


def _rendered(tokenizer, messages: list[dict], generation_prompt: bool = False) -> str:
    if not messages:
        return ""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def _pieces(tokenizer, msgs: list[dict], assistant_only: bool) -> list[tuple[str, bool]]:
    """The rendered conversation cut where each assistant turn starts (where the template's generation
    prompt for the turns before it ends) and where it ends: ``(text, is an assistant turn)`` in order,
    the texts joined being the whole rendering.

    Raises:
        DataError: the template does not render the conversation as its turns one after another (a
            rendering of the first turns is no prefix of the whole), so the assistant turns cannot be found.
    """
    full, pieces, done = _rendered(tokenizer, msgs), [], 0
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        before, upto = _rendered(tokenizer, msgs[:i], True), _rendered(tokenizer, msgs[:i + 1])
        if not (full.startswith(upto) and upto.startswith(before) and before.startswith(full[:done])):
            raise DataError(f"{'data.assistant_only_loss' if assistant_only else 'messages data'}: the chat "
                            "template does not render a conversation as its turns one after another, so the "
                            "assistant turns cannot be found; "
                            f"{'set it to false' if assistant_only else 'use prompt-completion data'}")
        pieces += [(before[done:], False), (upto[len(before):], True)]
        done = len(upto)
    return pieces + [(full[done:], False)]


def require_template(tokenizer) -> None:
    """Raises DataError (one line) when the tokenizer has no chat template, which messages data needs."""
    if not has_template(tokenizer):
        raise DataError("the data is messages (role/content turns) but the tokenizer has no chat template: use a "
                        "model whose tokenizer has one (e.g. packaged:SmolLM2-135M-Instruct) or prompt-completion "
                        "data")


def messages(tokenizer, msgs: list[dict], max_length: int, assistant_only: bool) -> dict | None:
    """One ``messages`` row as ``input_ids`` (list[int], at most ``max_length``), ``labels`` (list[int] as
    long: the ids, -100 outside the assistant turns under ``assistant_only``), ``prompt_length`` (int: the
    ids before the last assistant turn, the prompt evaluation generates after) and ``truncated`` (bool);
    None when truncation to ``max_length`` leaves no target token.

    Each assistant turn (its text and end-of-turn, here ``<|im_end|>\\n``) and the text between two turns
    are tokenized apart and joined (:func:`_pieces`), as a prompt-completion row's prompt and completion
    are: a turn's first token cannot merge with the ``\\n`` that ends the template's generation prompt
    (SmolLM2: ``"assistant\\n"`` + ``"\\n\\nHi"`` tokenized together ends ``istant`` ``ĊĊ`` ``Ċ`` ``Hi``, 1116
    neither prompt nor answer; apart, the prompt ends ``Ċ`` 198 and the answer is 198 198 ``Hi``), so the
    ids before a turn are the template's generation prompt's ids (what evaluation generates after) and
    every id of the turn is a target. Where nothing merges, the ids are those of the whole rendering
    tokenized at once.

    Raises:
        DataError: the tokenizer has no chat template; the template does not render the conversation as
            its turns one after another (assistant turns cannot be found).
    """
    require_template(tokenizer)
    ids, mask, last_start = [], [], 0
    for text, is_turn in _pieces(tokenizer, msgs, assistant_only):
        piece = token_ids(tokenizer, text) if text else []
        last_start = len(ids) if is_turn else last_start
        ids += piece
        mask += [1 if is_turn or not assistant_only else 0] * len(piece)
    truncated = len(ids) > max_length
    ids, mask = ids[:max_length], mask[:max_length]
    if 1 not in mask[1:]:  # the first token is never a target (nothing predicts it)
        return None
    labels = [t if k else IGNORE_INDEX for t, k in zip(ids, mask)]
    return {"input_ids": ids, "labels": labels, "prompt_length": min(last_start, len(ids)), "truncated": truncated}


def reference(row: dict) -> str:
    """The answer a generation is scored against: the completion's text, or the last assistant turn's."""
    if "messages" in row:
        answers = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
        return answers[-1] if answers else ""
    c = row["completion"]
    return " ".join(m["content"] for m in c) if isinstance(c, list) else c


def tokenize_row(tokenizer, row: dict, max_length: int, completion_only: bool, assistant_only: bool) -> dict | None:
    """:func:`prompt_completion` or :func:`messages` for ``row`` (a dict of :mod:`onegpu.data.instructions`)."""
    if "messages" in row:
        return messages(tokenizer, row["messages"], max_length, assistant_only)
    return prompt_completion(tokenizer, row["prompt"], row["completion"], max_length, completion_only)


def completion_only(cfg_value, fmt: str) -> bool:
    """``data.completion_only_loss`` resolved: null = on for prompt-completion data (TRL's default)."""
    return fmt == formats.PROMPT_COMPLETION if cfg_value is None else bool(cfg_value)
