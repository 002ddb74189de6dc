"""De-duplication (every dropped row counted under one reason) and the seeded, stratified splits."""
from __future__ import annotations

from onegpu.config import DataConfig, causal_lm
from onegpu.errors import DataError

SPLITS = ("train", "validation", "test")


def drop_rows(items: list, labels: list, reasons, key, empty) -> tuple[list, list, dict[str, int]]:
    """Keep ``items`` (and their ``labels``) in order, dropping each one for which ``empty(item, label)``
    names a reason, then repeats of an earlier kept ``key(item)``. Returns the kept items, their labels
    and ``{reason: rows}`` for every name in ``reasons`` (zeros included; ``duplicate`` among them)."""
    seen, kept, kept_labels = set(), [], []
    dropped = dict.fromkeys(reasons, 0)
    for item, label in zip(items, labels):
        k = key(item)
        reason = empty(item, label) or ("duplicate" if k in seen else None)
        if reason:
            dropped[reason] = dropped.get(reason, 0) + 1
            continue
        seen.add(k)
        kept.append(item)
        kept_labels.append(label)
    return kept, kept_labels, dropped


def dataset(columns: dict[str, list], labels: list[str], names: list[str]):
    """A ``datasets.Dataset`` of ``columns`` (each a list of cells, one per row) and ``label`` (a
    ``ClassLabel`` over ``names``).

    Raises:
        DataError: a column whose cells are not all of one type (strings in some rows, lists of messages
            in others), which an Arrow column cannot hold.
    """
    import pyarrow as pa
    from datasets import ClassLabel, Dataset
    try:
        ds = Dataset.from_dict({**columns, "label": labels})
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
        first_line = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise DataError(f"the columns {', '.join(columns)} must each hold cells of one type (all strings, or all "
                        f"lists of role/content messages): {first_line}") from None
    return ds.cast_column("label", ClassLabel(names=names))


def split(columns: dict[str, list], labels: list[str], cfg: DataConfig, task: str = "sequence-classification"):
    """Seeded train/validation/test split with ``datasets``, stratified by label, then the caps.

    Causal LM accepts a single label (then the split is not stratified). Which rows go where depends on
    the labels, the seed and the sizes only, never on the cells.

    Args:
        columns: the format's data columns (``text``; ``prompt`` + ``completion``; ``messages``), one cell per row.
        labels: one string per row.
    Returns:
        ``datasets.DatasetDict`` with splits train/validation/test, the ``columns`` and ``label``
        (``ClassLabel`` over the sorted label names).
    Raises:
        DataError: no row; fewer than two labels, or a label with too few rows to appear in every split.
    """
    from datasets import DatasetDict
    if not labels:
        raise DataError(f"data.source={cfg.source!r}: no row has a non-blank text in data.text_column="
                        f"{cfg.text_column!r}")
    names = sorted(set(labels))
    if len(names) < 2 and not causal_lm(task):
        raise DataError(f"the data has a single label ({names[0]!r}) in data.label_column={cfg.label_column!r}; "
                        "classification needs at least two")
    counts = {n: labels.count(n) for n in names}
    few = {n: c for n, c in counts.items() if c < 3}
    if few:
        raise DataError(f"labels with fewer than 3 rows cannot appear in train, validation and test: {few}")
    ds = dataset(columns, labels, names)
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
        raise DataError(f"cannot split {len(labels)} rows with {len(names)} labels stratified into train, "
                        f"validation and test (data.validation_size={cfg.validation_size}, "
                        f"data.test_size={cfg.test_size}, data.max_train_samples={cfg.max_train_samples}, "
                        f"data.max_eval_samples={cfg.max_eval_samples}): {first_line}") from None
    if not causal_lm(task):
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
