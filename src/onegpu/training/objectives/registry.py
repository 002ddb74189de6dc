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


def model_inputs(dsd, task: str = "sequence-classification"):
    """The prepared dataset(s) reduced to the columns ``model.task`` ``task``'s model consumes (its
    objective's :meth:`~onegpu.training.objectives.base.Objective.model_inputs`: a classifier's ``label``
    renamed ``labels``; a causal LM's dropped, the collator makes token labels). Works on a
    ``DatasetDict`` or a single ``Dataset``.

    Raises:
        ConfigError: no objective has that name.
    """
    return get(task).model_inputs(dsd)


def collator_for(task: str, tokenizer, padding_free: bool = False):
    """The micro-batch collator of ``model.task`` ``task``'s objective: padding per micro-batch, or (a
    token-level objective, ``padding_free``) one flattened row per micro-batch
    (:class:`~onegpu.training.objectives.batches.PaddingFreeCollator`).

    Raises:
        ConfigError: no objective has that name.
    """
    return get(task).collator(tokenizer, padding_free)


def count_items(labels, task: str):
    """Items (targets) in one micro-batch of ``model.task`` ``task``, as its objective counts them
    (:func:`~onegpu.training.objectives.loss.count_examples`, :func:`~onegpu.training.objectives.loss.count_targets`):
    a 0-dim int64 tensor on ``labels``' device.

    Raises:
        ConfigError: no objective has that name.
    """
    return get(task).count_items(labels)


def loss_for(task: str):
    """The loss function of ``model.task`` ``task``'s objective (signature ``(outputs, labels,
    num_items_in_batch)``).

    Raises:
        ConfigError: no objective has that name.
    """
    return get(task).loss


def validation_metrics(model, tokenizer, validation, cfg: Config, device: str) -> dict:
    """The validation split's figures during training, under ``eval_``: a classifier's loss, accuracy and
    macro F1, a causal LM's loss, perplexity and mean token accuracy (no generation: too slow per point),
    exact over the split as the test split's are (the objective's
    :meth:`~onegpu.training.objectives.base.Objective.heldout_metrics`,
    :mod:`onegpu.training.objectives.heldout`). The model is left in eval mode (the caller puts it back)."""
    from onegpu.training.objectives.heldout import EVAL
    return of(cfg).heldout_metrics(model, tokenizer, validation, cfg, device, EVAL)
