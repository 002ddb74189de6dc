"""The training objectives, one module each, registered here by ``model.task``: what a task trains on
(its rows and collator), how its items are counted and its loss computed (exact under accumulation), its
held-out figures (:class:`~onegpu.training.objectives.base.Objective`).

The backends, the ``auto`` finder, ``onegpu estimate``, validation and the evaluate stage ask
:func:`get` for the objective instead of comparing ``model.task`` with a string, so a new objective (the
preference objective: DPO) is one module and its :func:`register` call; an unknown task fails in one
line (``config.TASKS`` lists the names the params accept: ``tests/unit/training/objectives`` checks both
agree).
"""
from __future__ import annotations

from onegpu.training.objectives import causal_lm, classification, preference, reinforcement
from onegpu.training.objectives.base import Objective, TrainingParts
from onegpu.training.objectives.registry import (
    REGISTRY,
    collator_for,
    count_items,
    flattened,
    get,
    loss_for,
    model_inputs,
    of,
    packed,
    register,
    train_rows,
    training_parts,
    validation_metrics,
)

for _module in (classification, causal_lm, preference, reinforcement):
    register(_module.OBJECTIVE)
del _module

__all__ = ["Objective", "REGISTRY", "TrainingParts", "causal_lm", "classification", "collator_for", "count_items",
           "flattened", "get", "loss_for", "model_inputs", "of", "packed", "preference", "register", "reinforcement",
           "train_rows", "training_parts", "validation_metrics"]
