"""Conversational data (:data:`onegpu.data.formats.MESSAGES`, TRL's name): a ``messages`` column, each cell a
list of ``{role, content}`` turns (in a CSV, their JSON text), read from a table (.jsonl, .csv, .parquet;
:mod:`onegpu.data.instructions`). It needs a chat template; the loss is on every token, or on the assistant
turns under ``data.assistant_only_loss`` (a conversation without one is then refused, naming its row).
"""
from __future__ import annotations

from onegpu.config import Config
from onegpu.data import chat, formats, tokens
from onegpu.data.base import Rows
from onegpu.data.instructions import InstructionReader


class MessagesReader(InstructionReader):
    """``messages`` rows, tokenized turn by turn (:func:`onegpu.data.chat.messages`)."""
    format = formats.MESSAGES
    columns = formats.COLUMNS[formats.MESSAGES]
    drop_reasons = formats.DROP_REASONS[formats.MESSAGES]

    def read(self, cfg: Config) -> Rows:
        return self.read_table(cfg)

    def cells(self, record: dict, where: str, cfg: Config, csv_text: bool) -> dict:
        """The row's messages (an empty cell: ``[]``, dropped later). Raises DataError: a cell that is not a list
        of role/content turns; no assistant turn under ``data.assistant_only_loss``."""
        value, source = record.get("messages"), cfg.data.source
        msgs = formats.messages_cell(value, where, source, csv_text=csv_text) if value else []
        if msgs:
            formats.check_roles(msgs, where, source, cfg.data.assistant_only_loss)
        return {"messages": msgs}

    def empty(self, row: dict, label: str) -> str | None:
        return "empty_messages" if not row["messages"] else None

    def needs(self, cfg: Config) -> str:
        return "a non-empty messages list of role/content turns"

    def tokenize(self, dsd, tokenizer, cfg: Config):
        """As :meth:`InstructionReader.tokenize`. Raises DataError (before any row): ``data.max_length`` above
        the model's limit; a tokenizer without a chat template."""
        tokens.check_limit(tokenizer, cfg.data.max_length)
        chat.require_template(tokenizer)
        return super().tokenize(dsd, tokenizer, cfg)


READER = MessagesReader()
