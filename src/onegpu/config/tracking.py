"""The ``tracking`` section (:class:`TrackingConfig`)."""
from __future__ import annotations

from dataclasses import dataclass

from onegpu.config.knobs import OutOfKey, knob


@dataclass
class TrackingConfig:
    experiment_name: str = knob("onegpu", help="the MLflow experiment", key=OutOfKey("where results are logged"),
                                rule=(lambda v: bool(v.strip()), "must be a non-empty string"))
