"""Prompts with a verifiable answer, what GRPO trains on: TRL's prompt-only type (a ``prompt`` cell, a string
or a conversational list of ``{role, content}`` messages) with an ``answer`` column that the reward functions
receive (:mod:`onegpu.training.objectives.rewards`: ``correctness`` compares a completion's final answer with
it). The model writes the completion, so a row has no target tokens: only the prompt is tokenized, rendered
as the model generates from it (the chat template's generation prompt where the tokenizer has one).

Sources: a table (.jsonl, .csv, .parquet; :mod:`onegpu.data.instructions`) and the packaged
``bbcnews-sections`` (:func:`sections`): each packaged article's headline and opening paragraph with its
BBC News section as the answer, derived from the corpus alone (no hub, nothing random), a demonstration
set, not a benchmark.

**Tokens** (:func:`prompt_ids`): the prompt's ids, at most ``data.max_length``; a longer prompt has its last
message (or its string) cut as a prompt-completion row's is (:func:`onegpu.data.chat.shortened`); a prompt
with nothing left to cut is dropped and counted (``prompt_too_long``). Rows with an empty prompt or answer
are dropped and counted too.
"""
from __future__ import annotations

from onegpu.config import PACKAGED_SECTIONS, Config
from onegpu.data import chat, files, prompt_completion, tokens
from onegpu.data.base import Rows
from onegpu.data.instructions import InstructionReader
from onegpu.errors import DataError

SECTIONS_INSTRUCTION = ("Which section of BBC News is this article from: business, entertainment, politics, "
                        "sports or tech? Reply with the section's name inside <answer></answer>.\n\n")
COLUMNS = ("prompt", "answer")
DROP_REASONS = ("empty_prompt", "empty_answer", "duplicate", "prompt_too_long")


def sections() -> Rows:
    """The packaged corpus as prompt -> answer rows: prompt = :data:`SECTIONS_INSTRUCTION`, the headline and
    the article's first paragraph; answer = its section (the corpus's folder: business, entertainment,
    politics, sports, tech); labelled by section. A file with no text has an empty prompt (dropped later)."""
    root = files.bbcnews_dir()
    found, bad = files.text_files(root)
    prompts = []
    for _, text in found:
        head, _, body = text.strip().partition("\n")
        first = next((p.strip() for p in body.strip().split("\n\n") if p.strip()), "")
        prompts.append(f"{SECTIONS_INSTRUCTION}{head.strip()}\n\n{first}" if head.strip() else "")
    labels = [label for label, _ in found]
    return Rows({"prompt": prompts, "answer": list(labels)}, labels, root.resolve().as_uri(), bad)


def _answer(value, where: str, source: str) -> str:
    """An answer cell as text: a string (stripped) or a number (``12``, ``0.5``); None is ``""``."""
    if value is None:
        return ""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise DataError(f"data.source={source!r}: {where}: the answer cell is a {type(value).__name__}; it must be "
                        "a string or a number")
    return value.strip() if isinstance(value, str) else str(value)


def prompt_ids(tokenizer, prompt, max_length: int) -> tuple[list[int], bool] | None:
    """``(ids, truncated)``: the prompt rendered as the model generates from it (:func:`onegpu.data.chat.render`
    with an empty completion) and tokenized, at most ``max_length`` tokens; None when it cannot be cut to fit.

    Raises:
        DataError: a conversational prompt and a tokenizer without a chat template.
    """
    truncated = False
    for _ in range(8):  # each round cuts what is still over; decoding and re-encoding may shift a token
        ids = chat.token_ids(tokenizer, chat.render(tokenizer, prompt, "")[0])
        over = len(ids) - max_length
        if over <= 0:
            return ids, truncated
        prompt, truncated = chat.shortened(prompt, tokenizer, over), True
        if prompt is None:
            return None
    return None


def tokenize_prompts(dsd, tokenizer, max_length: int):
    """Every split's rows with ``prompt_ids`` and ``length`` (its tokens); the format's columns and ``label``
    stay. Returns ``(dsd, dropped, truncated)``. Raises DataError: a row :func:`prompt_ids` refuses (named by
    split and row); a split left empty."""
    def fn(ex, i, split):
        try:
            out = prompt_ids(tokenizer, ex["prompt"], max_length)
        except DataError as e:
            raise DataError(f"{split} row {i} (prompt {chat.last_text(ex['prompt'])[:40]!r}): {e}") from None
        if out is None:
            return {"prompt_ids": [], "length": 0, "truncated": False, "kept": False}
        return {"prompt_ids": out[0], "length": len(out[0]), "truncated": out[1], "kept": True}
    for s in dsd:
        dsd[s] = dsd[s].map(fn, with_indices=True, fn_kwargs={"split": s}, desc="tokenize prompts")
    return tokens.kept_rows(dsd, f"prompt fits data.max_length={max_length} tokens; raise data.max_length")


class PromptAnswerReader(InstructionReader):
    """Prompts and their verifiable answers (TRL's prompt-only rows with an ``answer`` column)."""
    format = "prompt-answer"
    columns = COLUMNS
    drop_reasons = DROP_REASONS

    def read(self, cfg: Config) -> Rows:
        return sections() if cfg.data.source == PACKAGED_SECTIONS else self.read_table(cfg)

    def cells(self, record: dict, where: str, cfg: Config, csv_text: bool) -> dict:
        source = cfg.data.source
        return {"prompt": prompt_completion.cell(record.get("prompt"), "prompt", where, source),
                "answer": _answer(record.get("answer"), where, source)}

    def empty(self, row: dict, label: str) -> str | None:
        return "empty_prompt" if not row["prompt"] else "empty_answer" if not row["answer"] else None

    def needs(self, cfg: Config) -> str:
        return "a non-blank prompt and a non-blank answer"

    def tokenize(self, dsd, tokenizer, cfg: Config):
        """:func:`tokenize_prompts`; its drops count as ``prompt_too_long``. Raises DataError: ``data.max_length``
        above the model's limit; a row :func:`prompt_ids` refuses; a split left empty."""
        tokens.check_limit(tokenizer, cfg.data.max_length)
        dsd, dropped, truncated = tokenize_prompts(dsd, tokenizer, cfg.data.max_length)
        return dsd, {"prompt_too_long": dropped}, truncated


READER = PromptAnswerReader()
