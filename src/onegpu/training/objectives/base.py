"""What every objective supplies (:class:`Objective`) and what training assembles from one
(:class:`TrainingParts`). No torch or transformers import here."""
from __future__ import annotations

from dataclasses import dataclass

from onegpu.config import causal_lm, token_level


@dataclass
class TrainingParts:
    """What both backends, the ``auto`` finder and ``onegpu estimate`` train or probe with: ``rows`` (the
    training split as the backends iterate it), ``collator`` (rows -> a micro-batch of tensors) and
    ``loss`` (``(outputs, labels, num_items_in_batch) -> 0-dim tensor``: this micro-batch's share of the
    optimizer step's mean)."""
    rows: object
    collator: object
    loss: object


class Objective:
    """One ``model.task``: its rows, collator, item count, loss and held-out figures (the model is a causal
    LM's for a token-level objective, a classifier's otherwise: :func:`onegpu.training.session.build_model`).
    Registered in :mod:`onegpu.training.objectives` by its ``task``.

    ``task``: the ``model.task`` value; its traits are declared with the params (``config.TASK_TRAITS``).
    """
    task: str = ""

    @property
    def token_level(self) -> bool:
        """Whether the items are a causal LM's target tokens (padding-free batches, packing, the fused LM
        head and generation apply), not examples: ``config.TASK_TRAITS``."""
        return token_level(self.task)

    @property
    def causal_lm(self) -> bool:
        """Whether the model is a causal LM (padding-free batches and the fused LM head apply):
        ``config.TASK_TRAITS``."""
        return causal_lm(self.task)

    # The functions of :mod:`onegpu.training.objectives.loss` that count a micro-batch's items and give its loss, by
    # name (looked up at each call); an objective with its own :meth:`count_items` and :meth:`loss` leaves them empty.
    items_fn = ""  # labels -> a 0-dim int64 tensor
    loss_fn = ""  # (outputs, labels, num_items_in_batch) -> a 0-dim tensor

    def count_items(self, labels):
        """The items of one micro-batch's ``labels``: a 0-dim int64 tensor on their device (``items_fn``)."""
        return self._loss_function(self.items_fn)(labels)

    def loss(self, outputs, labels, num_items_in_batch=None):
        """This micro-batch's summed loss divided by ``num_items_in_batch`` (the whole optimizer step's
        items; None: this micro-batch's): a 0-dim tensor (``loss_fn``)."""
        return self._loss_function(self.loss_fn)(outputs, labels, num_items_in_batch)

    @staticmethod
    def _loss_function(name: str):
        if not name:
            raise NotImplementedError
        from onegpu.training.objectives import loss
        return getattr(loss, name)

    # Sequences one item puts through the model (a preference pair: 2); the step's examples count items.
    sequences_per_item = 1
    # Whether :meth:`step_loss` is the objective's own (more than the model's forward and :meth:`loss`: a
    # reference model, say); HF Trainer's backend then calls it instead of its own forward and loss function.
    own_forward = False

    # Why ``onegpu estimate`` and ``onegpu tradeoffs`` cannot measure this objective yet (None: they can).
    not_measured_yet: str | None = None
    # Whether the activation probe (the first micro-batch's forward and backward before step 1,
    # :func:`onegpu.training.around_steps.activation_probe`) measures this objective's training rows.
    probes_activations = True

    def sampler(self, rows, cfg):
        """The training rows' sampler (an iterable of indices with ``__len__`` and ``set_epoch``); None: Trainer's
        shuffling ``RandomSampler``, reseeded per epoch."""
        return None

    def start_words(self, cfg) -> tuple[str, str]:
        """What the start line calls a step's items and the training rows
        (:class:`onegpu.training.around_steps.Start`)."""
        return "examples", "training examples"

    def step_batches(self, model, micro_batches: list[dict], step: int) -> list[dict]:
        """One optimizer step's micro-batches (collated, on the device) as ``model`` trains on them at optimizer
        step ``step`` (from 1): the loader's own, but for an objective that makes them in the step (GRPO's
        generations); the same number, before they are counted."""
        return micro_batches

    def count_batch(self, inputs: dict):
        """The items of one collated micro-batch: :meth:`count_items` of its ``labels``."""
        return self.count_items(inputs["labels"])

    def step_loss(self, model, inputs: dict, num_items):
        """Forward one collated micro-batch (``labels`` included) through ``model`` and return its share of
        the optimizer step's loss (:meth:`loss` of the outputs, divided by the step's ``num_items``)."""
        features = {k: v for k, v in inputs.items() if k != "labels"}
        return self.loss(model(**features), inputs["labels"], num_items)

    def pad_loss(self, model, inputs: dict):
        """A loss of 0 with a whole graph: :meth:`step_loss` times 0 for a micro-batch that only keeps several
        processes' collectives in step (every row a repeat, :func:`onegpu.training.objectives.batches.collate_own`):
        its backward adds exactly 0 to every gradient and nothing to the step's figures."""
        return self.step_loss(model, inputs, 1) * 0

    def shard(self, model, shard_fn) -> None:
        """Under ``train.fsdp``, after ``model`` is sharded: ``shard_fn(module)`` on each model the objective keeps
        beside it (DPO's frozen reference), so that it is sharded too; nothing here."""

    def step_figures(self, model):
        """A callable giving the objective's own per-step metrics at each optimizer step (None: none)."""
        return None

    def run_tags(self, model) -> dict[str, str]:
        """MLflow tags the objective adds to the training run of ``model`` (as built), once it has trained."""
        return {}

    def run_tables(self, model) -> dict[str, dict[str, list]]:
        """MLflow tables (artifact file -> column -> values) the objective adds to the training run of ``model``
        once it has trained (``MlflowClient.log_table``; none here): the live dicts it fills while training, which
        the checkpoints keep and a resume refills in place (:attr:`onegpu.training.record.recorder.StepRecorder.
        tables`)."""
        return {}

    def restart_step(self, model) -> None:
        """Forget what the current optimizer step's micro-batches added to :meth:`step_figures` (an
        out-of-memory retry redoes them all)."""

    def estimate_line(self, model) -> str | None:
        """``onegpu estimate``'s line on memory the objective keeps beside the model (None: none)."""
        return None

    def prepared_data(self, dsd, model, tokenizer, cfg):
        """The prepared ``DatasetDict`` as this run trains and validates on it (``dsd`` itself but for an
        objective that adds columns before the first step: DPO's precomputed reference)."""
        return dsd

    def memory_terms(self, model) -> dict[str, int]:
        """The objective's own terms of the run's memory breakdown (bytes; none but a reference model's)."""
        return {}

    def prepare_model(self, model, cfg) -> None:
        """Set up what the objective keeps beside a freshly built model (nothing, but for a reference)."""

    def dropout(self, cfg):
        """The dropout probability the model is built with (``model.dropout``; null keeps the model's)."""
        return cfg.model.dropout

    def model_inputs(self, dsd):
        """The prepared ``DatasetDict`` (or one ``Dataset``) reduced to the model's columns."""
        raise NotImplementedError

    def collator(self, tokenizer, flattened: bool = False):
        """Rows -> a micro-batch of tensors (``flattened``: one padding-free row, token-level only)."""
        raise NotImplementedError

    def heldout_metrics(self, model, tokenizer, dataset, cfg, device: str, prefix: str) -> dict:
        """The split's exact figures under ``prefix`` (``eval`` during training, ``test`` in evaluate)."""
        raise NotImplementedError

    def test_figures(self, model, tokenizer, dataset, cfg, device: str) -> tuple[dict, list[int], list[int]]:
        """The test split's ``test_*`` figures (:meth:`heldout_metrics`) and the gold and predicted class ids
        (a classifier's, for its confusion matrix; empty lists otherwise)."""
        from onegpu.training.objectives.heldout import TEST
        return self.heldout_metrics(model, tokenizer, dataset, cfg, device, TEST), [], []

    def result_line(self, metrics: dict) -> str:
        """The evaluate stage's last line: what it measured on the test split, in the task's words."""
        raise NotImplementedError
