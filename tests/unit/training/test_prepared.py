"""The prepared data as the train stage reads it (onegpu.training.prepared)."""
from __future__ import annotations

import json

import pytest

from onegpu import paths
from onegpu.errors import DataError
from onegpu.training import prepared


def test_missing_prepared_data_is_one_data_error_naming_the_stage_to_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError, match=r"is missing: run the prepare stage first \(dvc repro\)$"):
        prepared.load_stats()
    with pytest.raises(DataError, match="run the prepare stage first"):
        prepared.load_processed()


def test_stats_are_read_once_prepare_wrote_them(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    stats = {"fingerprint": "f" * 16, "labels": ["a", "b"]}
    paths.PROCESSED.mkdir(parents=True)
    paths.STATS.write_text(json.dumps(stats))
    assert prepared.load_stats() == stats
