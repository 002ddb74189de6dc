"""onegpu.evaluation: what the evaluate stage measures, and under which interpreter settings."""
from __future__ import annotations

import gc
import types

from onegpu import evaluation, interpreter
from onegpu.config import from_container


def test_the_evaluation_loop_runs_with_cpythons_collector_after_the_commands_start_up(monkeypatch, collector):
    """`onegpu evaluate` starts with onegpu.interpreter's start-up threshold; the measured loop (here the
    classifier's) runs with CPython's default thresholds, the start-up objects frozen, as training's does."""
    seen = []
    monkeypatch.setattr(evaluation, "classifier_metrics", lambda *a: seen.append(
        (gc.get_threshold(), gc.get_freeze_count() > 0)) or ({}, [], []))
    cfg = from_container({}, source="test")
    interpreter.start()
    evaluation.metrics(None, None, types.SimpleNamespace(column_names=["text", "label"]), cfg, "cpu")
    assert seen == [(interpreter.DEFAULT_THRESHOLD, True)]
