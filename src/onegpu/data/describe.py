"""What prepare wrote, described: the content fingerprint and the stats (rows, lengths, drops)."""
from __future__ import annotations

import hashlib
import json
from collections.abc import Callable

from onegpu.data.splits import SPLITS


def fingerprint(dsd, texts: Callable) -> str:
    """SHA-256 (first 16 hex digits) over every split's rows and labels, in order; ``texts(split)`` gives each
    row as one string (the reader's row key: the text, or an instruction row's sorted-key JSON)."""
    h = hashlib.sha256()
    for s in SPLITS:
        for t, label in zip(texts(dsd[s]), dsd[s]["label"]):
            h.update(f"{s}\t{label}\t{t}\n".encode())
    return h.hexdigest()[:16]


def stats(dsd, texts: Callable, *, rows_read: int, dropped: dict[str, int], undecodable: int, max_length: int) -> dict:
    """Rows per split and label, token-length percentiles per split, and what was dropped.

    ``texts``: as for :func:`fingerprint`. ``rows_dropped`` holds the rows dropped per reason
    (:meth:`onegpu.data.base.Reader.deduplicate` and tokenization); ``rows_kept`` = rows read
    minus all of them, before the splits' caps (``data.max_*_samples``). ``duplicates_removed`` repeats
    ``rows_dropped["duplicate"]``. Token lengths are counted after truncation to ``max_length``;
    ``truncated_share`` is the share of rows that hit the limit.
    """
    import numpy as np
    names = dsd["train"].features["label"].names
    out: dict = {"rows_read": rows_read, "rows_kept": rows_read - sum(dropped.values()),
                 "rows_dropped": dict(dropped), "duplicates_removed": dropped.get("duplicate", 0),
                 "undecodable_files": undecodable,
                 "labels": names, "max_length": max_length, "fingerprint": fingerprint(dsd, texts), "splits": {}}
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


def metrics(stats: dict, undecodable: int) -> dict:
    """prepare's MLflow metrics from :func:`stats`: row counts, drops by reason, prompts truncated, and per
    split the rows, tokens, length percentiles and truncated share."""
    dropped = stats["rows_dropped"]
    metrics = {"rows_read": stats["rows_read"], "rows_kept": stats["rows_kept"],
               **{f"rows_dropped_{r}": n for r, n in dropped.items()},
               "duplicates_removed": dropped["duplicate"], "undecodable_files": undecodable,
               "prompts_truncated": stats.get("prompts_truncated", 0)}
    for s, st in stats["splits"].items():
        metrics.update({f"rows_{s}": st["rows"], f"tokens_{s}": st["tokens"],
                        f"length_p50_{s}": st["length_p50"], f"length_p90_{s}": st["length_p90"],
                        f"truncated_share_{s}": st["truncated_share"]})
    return metrics


def table(ds, columns: tuple[str, ...]):
    """One split as the MLflow dataset input shows it: a pandas DataFrame of the data ``columns`` (a list of
    messages as its JSON text) and ``label`` (the label names)."""
    import pandas as pd  # heavy: only when a run logs its data
    names = ds.features["label"].names
    cells = {c: [v if isinstance(v, str) else json.dumps(v, ensure_ascii=False) for v in ds[c]] for c in columns}
    return pd.DataFrame({**cells, "label": [names[i] for i in ds["label"]]})


def inputs(dsd, fmt: str, source_name: str, contexts: dict[str, str]) -> list[tuple]:
    """The MLflow dataset inputs of ``contexts`` (split -> MLflow context, e.g. ``{"train": "training"}``):
    ``(DataFrame, name, context)`` each, the DataFrame :func:`table` of the split in the format's columns
    (:data:`onegpu.data.formats.COLUMNS`) and the name ``<data.source>-<split>``. prepare, the training
    run and evaluate log the same split the same way, so MLflow gives it the same digest in each run."""
    from onegpu.data import formats
    return [(table(dsd[s], formats.COLUMNS[fmt]), f"{source_name}-{s}", c) for s, c in contexts.items()]
