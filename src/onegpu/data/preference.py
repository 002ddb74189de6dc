"""Preference data (:data:`onegpu.data.formats.PREFERENCE`, TRL's preference type): each row a prompt and two
answers to it, ``chosen`` (preferred) and ``rejected``; each cell a string or (conversational) a list of
``{role, content}`` messages. With a ``prompt`` column the prompt is explicit; without one it is implicit in
both answers and split off as TRL does (``trl.data_utils.maybe_extract_prompt``: the longest common prefix
of the two, by messages or by characters).

Sources: a table (.jsonl, .csv, .parquet; :mod:`onegpu.data.instructions`) and the packaged
``bbcnews-headline-pairs`` (:func:`headline_pairs`), a demonstration set, not a benchmark.

**Tokens** (:func:`pair`): each answer is rendered after the prompt as a prompt-completion row is
(:func:`onegpu.data.chat.render`: the chat template where the tokenizer has one, a string becoming one user
or assistant turn), prompt and answer tokenized apart and joined, so both sequences of a pair start with the
same prompt ids, those the model generates from. A prompt whose rendering alone is not a prefix of its
rendering with an answer is refused with the row (TRL warns and trains on a context that differs).
**Truncation** cuts the prompt, never an answer, as for prompt-completion rows: the prompt's last message is
shortened until the longer sequence fits ``data.max_length``; a pair whose answer does not fit even so is
dropped and counted (``answer_too_long``). Rows with an empty prompt or answer, or two identical answers (no
preference to learn: a tie whose loss is ln 2 whatever the weights), are dropped and counted too.
"""
from __future__ import annotations

import random

from onegpu.config import PACKAGED_PAIRS, Config
from onegpu.data import chat, formats, prompt_completion, tokens
from onegpu.data.base import Rows
from onegpu.data.instructions import InstructionReader
from onegpu.errors import DataError

# The seed of the packaged pairs' rejected headlines: fixed, so the packaged set (and its fingerprint) is one.
PAIRS_SEED = 0


def headline_pairs() -> Rows:
    """The packaged corpus as preference rows: prompt = the headline instruction and the article body
    (:func:`onegpu.data.prompt_completion.headlines`), chosen = the article's own headline, rejected = the
    headline of another article of the same topic (a choice seeded by :data:`PAIRS_SEED` and the article, so
    the corpus's repeated articles make repeated pairs, dropped as duplicates, among the topic's other
    headlines), so the pair is hard: both answers are BBC headlines on the topic. Labelled by topic."""
    rows = prompt_completion.headlines()
    heads, prompts = rows.columns["completion"], rows.columns["prompt"]
    by_topic: dict[str, list[str]] = {}
    for head, topic in zip(heads, rows.labels):
        if head:
            by_topic.setdefault(topic, []).append(head)
    rejected = []
    for prompt, head, topic in zip(prompts, heads, rows.labels):
        others = [h for h in by_topic.get(topic, []) if h != head]
        rng = random.Random(f"{PAIRS_SEED}\n{prompt}\n{head}")  # seeded by the article: its repeats pair alike
        rejected.append(rng.choice(others) if head and others else "")
    return Rows({"prompt": rows.columns["prompt"], "chosen": heads, "rejected": rejected}, rows.labels,
                rows.source, rows.undecodable)


def _cell(value, column: str, where: str, source: str):
    """A preference cell: a string (as given) or a conversational list of messages; None is ``""``.

    Raises:
        DataError: neither (:func:`onegpu.data.formats.messages_cell` names the problem).
    """
    if value is None:
        return ""
    if isinstance(value, list):
        return formats.messages_cell(value, where, source, column)
    if not isinstance(value, str):
        raise DataError(f"data.source={source!r}: {where}: the {column} cell is a {type(value).__name__}; it must "
                        "be a string or a list of {role, content} messages")
    return value


def _blank(cell) -> bool:
    return not cell or (isinstance(cell, str) and not cell.strip())


def pair(tokenizer, prompt, chosen, rejected, max_length: int) -> dict | None:
    """One preference row as ``prompt_ids``, ``chosen_ids``, ``rejected_ids`` (lists of int: the prompt's
    ids, then each answer's, so prompt + answer is one sequence of at most ``max_length`` tokens) and
    ``truncated`` (the prompt was cut); None when an answer does not fit even after the prompt is cut as far
    as it can be (see the module docstring).

    Raises:
        DataError: the prompt renders differently alone than before an answer (:func:`onegpu.data.chat.render`,
            ``strict``); conversational cells and a tokenizer without a chat template.
    """
    truncated = False
    for _ in range(8):  # each round cuts what is still over; decoding and re-encoding may shift a token
        p_text, c_text = chat.render(tokenizer, prompt, chosen, strict=True)
        _, r_text = chat.render(tokenizer, prompt, rejected, strict=True)
        p_ids = chat.token_ids(tokenizer, p_text)
        c_ids, r_ids = chat.token_ids(tokenizer, c_text), chat.token_ids(tokenizer, r_text)
        over = len(p_ids) + max(len(c_ids), len(r_ids)) - max_length
        if over <= 0:
            return {"prompt_ids": p_ids, "chosen_ids": c_ids, "rejected_ids": r_ids, "truncated": truncated}
        prompt = chat.shortened(prompt, tokenizer, over)
        truncated = True
        if prompt is None:
            return None
    return None


def tokenize_pairs(dsd, tokenizer, max_length: int):
    """Every split's rows as :func:`pair`'s columns plus ``length`` (the longer sequence's tokens: the
    pair's padded row); the format's columns and ``label`` stay.

    Returns:
        ``(dsd, dropped, truncated)``: pairs that could not fit were dropped (``dropped`` counts them over
        all splits); ``truncated`` counts pairs whose prompt was cut.
    Raises:
        DataError: a row :func:`pair` refuses (named by split and row, with the start of its prompt); no
            pair of a split fits ``data.max_length``.
    """
    def fn(ex, i, split):
        try:
            out = pair(tokenizer, ex["prompt"], ex["chosen"], ex["rejected"], max_length)
        except DataError as e:
            start = chat.last_text(ex["prompt"])
            raise DataError(f"{split} row {i} (prompt {start[:40]!r}): {e}") from None
        if out is None:
            return {"prompt_ids": [], "chosen_ids": [], "rejected_ids": [], "truncated": False, "length": 0,
                    "kept": False}
        longer = max(len(out["chosen_ids"]), len(out["rejected_ids"]))
        return {**out, "length": len(out["prompt_ids"]) + longer, "kept": True}
    for s in dsd:
        dsd[s] = dsd[s].map(fn, with_indices=True, fn_kwargs={"split": s}, desc="tokenize pairs")
    return tokens.kept_rows(dsd, f"pair fits data.max_length={max_length} tokens with both answers whole (the "
                            "prompt is cut, never an answer); raise data.max_length")


class PreferenceReader(InstructionReader):
    """Preference rows (TRL's explicit or implicit prompt); what DPO trains on."""
    format = formats.PREFERENCE
    columns = formats.COLUMNS[formats.PREFERENCE]
    required = ("chosen", "rejected")
    drop_reasons = formats.DROP_REASONS[formats.PREFERENCE]

    def read(self, cfg: Config) -> Rows:
        return headline_pairs() if cfg.data.source == PACKAGED_PAIRS else self.read_table(cfg)

    def cells(self, record: dict, where: str, cfg: Config, csv_text: bool) -> dict:
        """The row's prompt, chosen and rejected; without a prompt cell (or one whose kind, string or
        messages, is not the answers'), the prompt is split off both answers as TRL does."""
        from trl.data_utils import maybe_extract_prompt  # heavy (torch): prepare has loaded it already
        source = cfg.data.source
        row = {c: _cell(record.get(c), c, where, source) for c in self.required}
        if {type(row["chosen"]), type(row["rejected"])} == {str, list}:
            raise DataError(f"data.source={source!r}: {where}: chosen is a {type(row['chosen']).__name__} and "
                            f"rejected a {type(row['rejected']).__name__}; both must be strings or both lists of "
                            "{role, content} messages")
        if record.get("prompt") is not None:
            row["prompt"] = _cell(record["prompt"], "prompt", where, source)
        if not (_blank(row["chosen"]) or _blank(row["rejected"])):  # (an empty answer is dropped, not split)
            row = maybe_extract_prompt(row)
        return {c: row.get(c, "") for c in self.columns}

    def empty(self, row: dict, label: str) -> str | None:
        for reason, column in (("empty_prompt", "prompt"), ("empty_chosen", "chosen"), ("empty_rejected", "rejected")):
            if _blank(row[column]):
                return reason
        return "identical_answers" if row["chosen"] == row["rejected"] else None

    def needs(self, cfg: Config) -> str:
        return "a non-blank prompt and two different non-blank answers (chosen, rejected)"

    def tokenize(self, dsd, tokenizer, cfg: Config):
        """:func:`tokenize_pairs`; its drops count as ``answer_too_long``. Raises DataError: ``data.max_length``
        above the model's limit; a row :func:`pair` refuses; a split left empty."""
        tokens.check_limit(tokenizer, cfg.data.max_length)
        dsd, dropped, truncated = tokenize_pairs(dsd, tokenizer, cfg.data.max_length)
        return dsd, {"answer_too_long": dropped}, truncated


READER = PreferenceReader()
