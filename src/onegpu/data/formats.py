"""Which kind of data a source holds, from its columns, as TRL decides it (standard library only).

TRL's dataset types (``trl.data_utils``, SFTTrainer, DPOTrainer): ``chosen`` + ``rejected`` columns (preference
pairs, with a ``prompt`` column or the prompt implicit in both answers), a ``messages`` column (a list of
``{role, content}`` per row: conversational language modelling), ``prompt`` + ``completion`` columns
(prompt-completion; a cell may be a string or, conversational, a list of messages), else plain text in the
text column. onegpu
reads them the same way; its own copy of ``trl.data_utils.is_conversational`` exists because importing
``trl.data_utils`` loads transformers and torch (seconds), and this check must answer before any heavy
import (:func:`onegpu.data.check.check_input`).
"""
from __future__ import annotations

import json

from onegpu.errors import DataError

TEXT, PROMPT_COMPLETION, MESSAGES, PREFERENCE = "text", "prompt-completion", "messages", "preference"
PROMPT_ANSWER = "prompt-answer"  # TRL's prompt-only rows with a verifiable answer (GRPO's)
ROLES = ("system", "user", "assistant", "tool")
# Each format's data columns: a reader keeps them as columns through the splits and tokenization.
COLUMNS = {TEXT: ("text",), PROMPT_COMPLETION: ("prompt", "completion"), MESSAGES: ("messages",),
           PREFERENCE: ("prompt", "chosen", "rejected"), PROMPT_ANSWER: ("prompt", "answer")}
# Why a row read from the source is not used, per format, in the order they are tested (a row counts once;
# the last of an instruction format's is counted by tokenization).
DROP_REASONS = {TEXT: ("empty_text", "empty_label", "duplicate"),
                PROMPT_COMPLETION: ("empty_prompt", "empty_completion", "duplicate", "completion_too_long"),
                MESSAGES: ("empty_messages", "duplicate", "no_target_after_truncation"),
                PREFERENCE: ("empty_prompt", "empty_chosen", "empty_rejected", "identical_answers", "duplicate",
                             "answer_too_long"),
                PROMPT_ANSWER: ("empty_prompt", "empty_answer", "duplicate", "prompt_too_long")}


def detect(columns) -> str:
    """:data:`PREFERENCE` for ``chosen`` and ``rejected`` columns, :data:`MESSAGES` when a ``messages`` column
    exists, :data:`PROMPT_COMPLETION` for ``prompt`` and ``completion`` columns, :data:`PROMPT_ANSWER` for
    ``prompt`` and ``answer`` columns (no completion), else :data:`TEXT`."""
    cols = set(columns)
    if {"chosen", "rejected"} <= cols:
        return PREFERENCE
    if "messages" in cols:
        return MESSAGES
    if {"prompt", "completion"} <= cols:
        return PROMPT_COMPLETION
    if {"prompt", "answer"} <= cols:
        return PROMPT_ANSWER
    return TEXT


def is_conversational(value) -> bool:
    """TRL's test (``trl.data_utils.is_conversational``) on one cell: a list whose first item is a dict
    with a ``role`` key."""
    return isinstance(value, list) and bool(value) and isinstance(value[0], dict) and "role" in value[0]


def messages_cell(value, where: str, source: str, column: str = "messages", csv_text: bool = False) -> list[dict]:
    """``value`` as a list of ``{"role": str, "content": str}``. A CSV cell (``csv_text``) is JSON text,
    parsed first; a string cell of a JSON Lines or Parquet file is parsed only when it holds a JSON list
    (otherwise it is reported as the string it is).

    Raises:
        DataError: one line naming ``where`` (e.g. ``row 12``): a CSV cell that is not JSON; not a list of
            role/content objects (``is a string ('just text')``, ``is a dict``); a role outside :data:`ROLES`.
    """
    allowed = 'a list of {"role": ..., "content": ...} objects'
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            if csv_text:
                raise DataError(f"data.source={source!r}: {where}: the {column} cell is not JSON; a CSV cell of "
                                f"{column} must be the JSON text of {allowed}") from None
            parsed = None
        if csv_text or isinstance(parsed, list):
            value = parsed
    if not isinstance(value, list) or not all(isinstance(m, dict) for m in value):
        kind = f"string ({value[:40]!r})" if isinstance(value, str) else type(value).__name__
        raise DataError(f"data.source={source!r}: {where}: the {column} cell is a {kind}, not {allowed}")
    for i, m in enumerate(value):
        if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DataError(f"data.source={source!r}: {where}: {column}[{i}] has keys {sorted(m)}; each message "
                            "needs a string role and a string content")
        if m["role"] not in ROLES:
            raise DataError(f"data.source={source!r}: {where}: {column}[{i}] has role {m['role']!r}; roles are "
                            f"{', '.join(ROLES)}")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def check_roles(messages: list[dict], where: str, source: str, assistant_only: bool) -> None:
    """Raises DataError when ``assistant_only`` (``data.assistant_only_loss``) and the conversation has no
    assistant turn: its loss would have no target."""
    if assistant_only and not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"data.source={source!r}: {where} has no assistant turn, so under data.assistant_only_loss "
                        "it has no token to learn from; add the assistant's answer or drop the row")
