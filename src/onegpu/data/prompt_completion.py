"""Prompt-completion data (:data:`onegpu.data.formats.PROMPT_COMPLETION`, TRL's name): ``prompt`` and
``completion`` columns, each cell a string or (conversational) a list of ``{role, content}`` messages.

Sources: a table (.jsonl, .csv, .parquet; :mod:`onegpu.data.instructions`) and the packaged
``bbcnews-headlines``: the packaged BBC corpus (:func:`onegpu.data.files.bbcnews_dir`) whose files' first
line is the headline (the completion); the prompt is :data:`HEADLINE_INSTRUCTION` followed by the article
body (the rest of the file), which tokenization truncates to fit ``data.max_length`` (:mod:`onegpu.data.chat`);
the topic folder is the row's label, so the splits stay stratified by topic.
"""
from __future__ import annotations

from onegpu.config import PACKAGED_HEADLINES, Config
from onegpu.data import files, formats
from onegpu.data.base import Rows
from onegpu.data.instructions import InstructionReader
from onegpu.errors import DataError

HEADLINE_INSTRUCTION = "Write the headline of this BBC News article.\n\n"


def headlines() -> Rows:
    """The packaged corpus as prompt (instruction + body) -> completion (headline) rows, labelled by topic;
    a file without a body has an empty prompt (dropped and counted later)."""
    root = files.bbcnews_dir()
    found, bad = files.text_files(root)
    prompts, completions = [], []
    for _, text in found:
        head, _, body = text.strip().partition("\n")
        prompts.append(HEADLINE_INSTRUCTION + body.strip() if body.strip() else "")
        completions.append(head.strip())
    return Rows({"prompt": prompts, "completion": completions}, [lab for lab, _ in found], root.resolve().as_uri(),
                bad)


def cell(value, column: str, where: str, source: str):
    """A prompt/completion cell: a string (stripped) or a conversational list of messages.

    Raises:
        DataError: neither a string nor a list of role/content messages (:func:`onegpu.data.formats.messages_cell`).
    """
    if value is None:
        return ""
    if formats.is_conversational(value) or isinstance(value, list):
        return formats.messages_cell(value, where, source, column)
    if not isinstance(value, str):
        raise DataError(f"data.source={source!r}: {where}: the {column} cell is a {type(value).__name__}; it must "
                        "be a string or a list of {role, content} messages")
    return value.strip()


class PromptCompletionReader(InstructionReader):
    """Prompt-completion rows; the loss is on the completion unless ``data.completion_only_loss: false``."""
    format = formats.PROMPT_COMPLETION
    columns = formats.COLUMNS[formats.PROMPT_COMPLETION]
    drop_reasons = formats.DROP_REASONS[formats.PROMPT_COMPLETION]

    def read(self, cfg: Config) -> Rows:
        return headlines() if cfg.data.source == PACKAGED_HEADLINES else self.read_table(cfg)

    def cells(self, record: dict, where: str, cfg: Config, csv_text: bool) -> dict:
        return {c: cell(record.get(c), c, where, cfg.data.source) for c in self.columns}

    def empty(self, row: dict, label: str) -> str | None:
        return "empty_prompt" if not row["prompt"] else "empty_completion" if not row["completion"] else None

    def needs(self, cfg: Config) -> str:
        return "a non-blank prompt and a non-blank completion"


READER = PromptCompletionReader()
