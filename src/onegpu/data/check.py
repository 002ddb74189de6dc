"""The data's form checked first, before any heavy import, any MLflow run or any output: one function,
:func:`check_input`, that the pipeline's first stage calls (and prepare again).

It reads only the header of a CSV (pandas, the parser prepare reads the file with), the first record of a
JSON Lines file (standard library) or the schema of a Parquet file (pyarrow's footer reader):
:func:`onegpu.data.files.header`. So a file without its label column, instruction
data without a completion, or a ``messages`` cell that is no list of messages fails in well under a second
with one line, instead of after prepare has loaded its libraries and opened a run. What only the whole
file shows (a bad cell on row 900) is found by prepare's reading, which also runs before its run opens.
"""
from __future__ import annotations

from pathlib import Path

from onegpu.config import PACKAGED_HEADLINES, Config, token_level
from onegpu.data import files, formats
from onegpu.errors import DataError


def _table_format(cfg: Config, path: Path) -> str:
    """The format of table ``path`` for ``cfg``'s task; raises DataError for missing columns."""
    d, task = cfg.data, cfg.model.task
    columns, first = files.header(path)
    fmt = formats.detect(columns) if token_level(task) else formats.TEXT
    listed = ", ".join(map(str, columns))
    if fmt == formats.TEXT:
        needed = [("data.text_column", d.text_column)] + (
            [("data.label_column", d.label_column)] if not token_level(task) else [])
        for key, col in needed:
            if col not in columns and first is None:  # JSON Lines: a later line may hold it (prepare decides)
                hint = (" (instruction data needs a completion column next to prompt)"
                        if "prompt" in columns and token_level(task) else "")
                raise DataError(f"{key}={col!r} is not a column of {path} (columns: {listed}){hint}")
    if first is not None and fmt == formats.MESSAGES:
        msgs = formats.messages_cell(first["messages"], "line 1", str(path))
        formats.check_roles(msgs, "line 1", str(path), d.assistant_only_loss)
    return fmt


def check_input(cfg: Config) -> str:
    """Check ``data.source`` and its columns against the task and the loss keys; return its format
    (:data:`~onegpu.data.formats.TEXT`, ``PROMPT_COMPLETION`` or ``MESSAGES``).

    Raises:
        DataError: the source is missing or of the wrong kind (:func:`~onegpu.data.files.check_source`);
            a column the task needs is missing; a first ``messages`` cell that is not a list of role/content
            (or has no assistant turn under ``data.assistant_only_loss``); ``data.completion_only_loss: true``
            on data without completions; ``data.assistant_only_loss: true`` on data without ``messages``.
    """
    d = cfg.data
    files.check_source(d)
    kind = files.source_kind(d.source)
    if d.source == PACKAGED_HEADLINES:
        fmt = formats.PROMPT_COMPLETION
    elif kind in ("package", "directory"):
        fmt = formats.TEXT
    else:
        fmt = _table_format(cfg, Path(d.source).expanduser())
    if d.completion_only_loss and fmt != formats.PROMPT_COMPLETION:
        raise DataError(f"data.completion_only_loss is true, but data.source={d.source!r} is {fmt} data: it needs "
                        "prompt and completion columns (set it to null or false)")
    if d.assistant_only_loss and fmt != formats.MESSAGES:
        raise DataError(f"data.assistant_only_loss is true, but data.source={d.source!r} is {fmt} data: it needs "
                        "a messages column of role/content turns (set it to false)")
    return fmt
