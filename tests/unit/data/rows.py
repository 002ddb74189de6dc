"""Helpers the data tests share: a config for a source, small CSV and JSON Lines files, ``<label>/*.txt`` trees."""
from __future__ import annotations

import csv
import json
from pathlib import Path

from onegpu.config import DataConfig, from_container


def cfg(source: str, task: str = "causal-lm", **data):
    """A whole Config for ``source`` (a causal LM built from config unless ``task`` says otherwise)."""
    model = {"task": task} if task != "causal-lm" else {"task": task, "name_or_path": None}
    return from_container({"data": {"source": source, **data}, "model": model})


def data_cfg(source: str, **kw) -> DataConfig:
    """The data section alone, split 70/10/20 with seed 0."""
    return DataConfig(source=source, validation_size=0.1, test_size=0.2, seed=0, **kw)


def classify(source: str, **data):
    """A classification Config for ``source`` split as :func:`data_cfg` splits."""
    return from_container({"data": {"source": source, "validation_size": 0.1, "test_size": 0.2, "seed": 0, **data},
                           "model": {"task": "sequence-classification"}})


def write_csv(path: Path, rows, header=("text", "label")) -> str:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
    return str(path)


def write_jsonl(path: Path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root
