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

from onegpu.config import PACKAGED_HEADLINES, PACKAGED_PAIRS, PACKAGED_SECTIONS, Config, causal_lm, token_level
from onegpu.data import files, formats
from onegpu.errors import DataError


def _table_format(cfg: Config, path: Path) -> str:
    """The format of table ``path`` for ``cfg``'s task; raises DataError for missing columns."""
    d, task = cfg.data, cfg.model.task
    columns, first = files.header(path)
    fmt = formats.detect(columns) if causal_lm(task) else formats.TEXT
    listed = ", ".join(map(str, columns))
    if fmt == formats.TEXT and task not in _PAIRED:  # (preference, grpo: _check_pairs names what is missing)
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


# The tasks that train on one format alone, and that format (the other way round too): its columns in words and
# the packaged source of it.
_PAIRED = {"preference": (formats.PREFERENCE, "chosen and rejected columns (and a prompt column, or the prompt "
                                              "inside both)", PACKAGED_PAIRS),
           "grpo": (formats.PROMPT_ANSWER, "prompt and answer columns (the answer the reward functions check)",
                    PACKAGED_SECTIONS)}


def _check_pairs(cfg: Config, fmt: str) -> None:
    """Raises DataError when preference data and ``model.task: preference`` (or prompt-answer data and
    ``model.task: grpo``) do not come together."""
    source, task = cfg.data.source, cfg.model.task
    if task in _PAIRED and fmt != _PAIRED[task][0]:
        needs, packaged = _PAIRED[task][1:]
        raise DataError(f"model.task is {task}, but data.source={source!r} is {fmt} data: {task} needs {needs}, "
                        f"e.g. data.source: {packaged}")
    for other, (own, needs, _) in _PAIRED.items():
        if fmt == own and task != other:
            raise DataError(f"data.source={source!r} is {fmt} data ({needs}), which model.task: {other} trains on, "
                            f"but model.task is {task}")


_PACKAGED = {PACKAGED_HEADLINES: formats.PROMPT_COMPLETION, PACKAGED_PAIRS: formats.PREFERENCE,
             PACKAGED_SECTIONS: formats.PROMPT_ANSWER}  # the packaged sources that are not plain text


def check_input(cfg: Config) -> str:
    """Check ``data.source`` and its columns against the task and the loss keys; return its format
    (:data:`~onegpu.data.formats.TEXT`, ``PROMPT_COMPLETION``, ``MESSAGES``, ``PREFERENCE`` or ``PROMPT_ANSWER``).

    Raises:
        DataError: the source is missing or of the wrong kind (:func:`~onegpu.data.files.check_source`);
            a column the task needs is missing; a first ``messages`` cell that is not a list of role/content
            (or has no assistant turn under ``data.assistant_only_loss``); preference data without
            ``model.task: preference`` or the other way round (prompt-answer data and ``model.task: grpo`` too);
            ``data.completion_only_loss: true``
            on data without completions; ``data.assistant_only_loss: true`` on data without ``messages``.
    """
    d = cfg.data
    files.check_source(d)
    kind = files.source_kind(d.source)
    if d.source in _PACKAGED:
        fmt = _PACKAGED[d.source]
    elif kind in ("package", "directory"):
        fmt = formats.TEXT
    else:
        fmt = _table_format(cfg, Path(d.source).expanduser())
    _check_pairs(cfg, fmt)
    if d.completion_only_loss and fmt != formats.PROMPT_COMPLETION:
        raise DataError(f"data.completion_only_loss is true, but data.source={d.source!r} is {fmt} data: it needs "
                        "prompt and completion columns (set it to null or false)")
    if d.assistant_only_loss and fmt != formats.MESSAGES:
        raise DataError(f"data.assistant_only_loss is true, but data.source={d.source!r} is {fmt} data: it needs "
                        "a messages column of role/content turns (set it to false)")
    return fmt
