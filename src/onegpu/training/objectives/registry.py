"""The objectives by ``model.task`` (:data:`REGISTRY`) and what training assembles from the run's one:
its rows, collator and loss (:func:`training_parts`), whether its batches are flattened or packed."""
from __future__ import annotations

from onegpu.config import Config
from onegpu.errors import ConfigError
from onegpu.training.objectives.base import Objective, TrainingParts

REGISTRY: dict[str, Objective] = {}


def register(objective: Objective) -> Objective:
    """Add ``objective`` under its ``task``; returns it."""
    REGISTRY[objective.task] = objective
    return objective


def get(task: str) -> Objective:
    """The objective of ``model.task`` ``task``.

    Raises:
        ConfigError: no objective has that name (one line naming the ones that exist).
    """
    try:
        return REGISTRY[task]
    except KeyError:
        raise ConfigError(f"model.task: {task!r} is not an objective onegpu trains; use one of "
                          f"{' | '.join(REGISTRY)}") from None


def of(cfg: Config) -> Objective:
    """The objective ``cfg.model.task`` names (:func:`get`)."""
    return get(cfg.model.task)


def flattened(cfg: Config) -> bool:
    """Whether training batches are flattened rows: a causal LM's objective with ``data.padding_free``, or
    ``data.packing`` (packed rows are always collated padding-free, as TRL does for its best-fit-decreasing
    packing)."""
    return of(cfg).causal_lm and (cfg.data.padding_free or cfg.data.packing)


def packed(cfg: Config) -> bool:
    """Whether the training rows are packed into rows of ``data.max_length`` (``data.packing``)."""
    return of(cfg).token_level and cfg.data.packing


def train_rows(dsd, cfg: Config, with_length: bool = False):
    """The training rows as the backends iterate them: the objective's model columns of ``dsd['train']``,
    packed into rows of ``data.max_length`` under ``data.packing`` (:func:`onegpu.data.packing.pack`).
    ``with_length``: keep prepare's ``length`` column on unpacked rows (the ``auto`` finder and the
    estimate pick the longest rows by it; packed rows are measured by their ``input_ids``)."""
    rows = of(cfg).model_inputs(dsd)["train"]
    if packed(cfg):
        from onegpu.data import packing
        return packing.pack(rows, cfg.data.max_length, cfg.train.seed)
    if with_length and "length" in dsd["train"].column_names:
        rows = rows.add_column("length", dsd["train"]["length"])
    return rows


def training_parts(dsd, cfg: Config, tokenizer, with_length: bool = False) -> TrainingParts:
    """The rows (:func:`train_rows`), collator (flattened: :func:`flattened`) and loss ``cfg`` trains with."""
    objective = of(cfg)
    return TrainingParts(train_rows(dsd, cfg, with_length), objective.collator(tokenizer, flattened(cfg)),
                         objective.loss)
