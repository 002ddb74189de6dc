"""The prepared data as the train stage reads it: data/processed (a ``DatasetDict``) and data/stats.json."""
from __future__ import annotations

from onegpu import paths
from onegpu.errors import DataError


def _require_prepared() -> None:
    if not paths.PROCESSED.is_dir() or not paths.STATS.is_file():
        raise DataError(f"{paths.PROCESSED} or {paths.STATS} is missing: run the prepare stage first (dvc repro)")


def load_processed():
    """The prepared ``DatasetDict`` from data/processed (splits ``train``, ``validation``, ``test``).

    Raises:
        DataError: prepare has not run.
    """
    from datasets import load_from_disk  # heavy (pyarrow): only when the data is read
    _require_prepared()
    return load_from_disk(str(paths.PROCESSED))


def load_stats() -> dict:
    """data/stats.json (``labels``, the content ``fingerprint``, split sizes).

    Raises:
        DataError: prepare has not run.
    """
    _require_prepared()
    return paths.read_json(paths.STATS)
