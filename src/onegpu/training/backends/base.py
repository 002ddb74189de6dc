"""The backend contract and the one registry of backends.

A backend is a module with a ``train(request: TrainRequest)`` function of the :class:`Backend` shape. To
add one: write ``onegpu/training/backends/<name>.py`` with that function, add ``"<name>": "<module>"`` to
:data:`REGISTRY`, and add the name to ``train.backend``'s allowed values in ``onegpu.config``
(``tests/unit/training/backends/test_base.py`` checks that both lists agree). Every ``train.*`` key the config accepts
must be honoured, or the config must refuse the combination with one line.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from onegpu.config import Config
    from onegpu.training.lifecycle.interrupt import GracefulStop
    from onegpu.training.lifecycle.resume import ResumePoint
    from onegpu.training.record.recorder import StepRecorder

# train.backend -> the module that implements it (imported only when that backend trains).
REGISTRY = {"trainer": "onegpu.training.backends.hf_trainer",
            "accelerate": "onegpu.training.backends.accelerate"}


@dataclass(frozen=True)
class TrainRequest:
    """One training, as the session asks a backend for it.

    Attributes:
        model: a float32 transformers model; tokenizer: its tokenizer (pads each micro-batch).
        dsd: the prepared ``DatasetDict`` (the backend trains on ``dsd["train"]`` and validates on
            ``dsd["validation"]`` as ``train.eval_strategy`` says, where it has that split:
            :mod:`onegpu.training.validation`).
        cfg: the params, with the batch layout in use in ``train``: ``per_device_train_batch_size`` is the
            micro-batch (an int: an ``auto`` one is the finder's, :func:`onegpu.config.with_layout`) and
            ``gradient_accumulation_steps`` the accumulation; the one place a backend reads them from.
        sink: receives ``(metrics, step)`` once per optimizer step (:class:`StepRecorder`: ``loss`` and the
            step's measurements), and once more after a validation point (its ``eval_*`` figures, no ``loss``).
        checkpoint_dir: where ``checkpoint-N`` folders go every ``train.save_steps`` steps and on a stop
            (None: no checkpoints); checkpoint_meta: extra keys for ``onegpu_state.json``.
        stop: a requested stop ends training after the step in progress, with a checkpoint.
        resume: a checkpoint to continue from; its step rows, breakdown and events are restored.
        oom_injector: tests only: ``(step, rows) -> True`` raises an injected out-of-memory error.
    """
    model: Any
    tokenizer: Any
    dsd: Any
    cfg: Config
    sink: Callable[[dict, int], None]
    checkpoint_dir: Any = None
    stop: GracefulStop | None = None
    resume: ResumePoint | None = None
    checkpoint_meta: dict | None = None
    oom_injector: Callable[[int, int], bool] | None = None


class Backend(Protocol):
    """What the training session calls (:func:`onegpu.training.session.train`)."""

    def train(self, request: TrainRequest) -> tuple[object, StepRecorder]:
        """Fine-tune ``request.model`` on ``request.dsd['train']``.

        Returns:
            The trained model (``save_pretrained`` saves it) and the step recorder.
        Raises:
            onegpu.training.lifecycle.interrupt.Interrupted: a stop was requested (after the checkpoint is saved).
            onegpu.training.record.recorder.TrainingDiverged: a step's loss is not finite.
        """
        ...


def get(name: str) -> Backend:
    """The backend module registered as ``name`` (a ``train.backend`` value), imported now.

    Raises:
        KeyError: ``name`` is not in :data:`REGISTRY` (the config refuses such a name first).
    """
    return importlib.import_module(REGISTRY[name])
