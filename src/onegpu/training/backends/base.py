"""The backend contract and the one registry of backends.

A backend is a module with a ``train`` function of the :class:`Backend` shape. To add one: write
``onegpu/training/backends/<name>.py`` with that function, add ``"<name>": "<module>"`` to
:data:`REGISTRY`, and add the name to ``train.backend``'s allowed values in ``onegpu.config``
(``tests/unit/test_backends.py`` checks that both lists agree). Every ``train.*`` key the config accepts
must be honoured, or the config must refuse the combination with one line.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Callable, Protocol

if TYPE_CHECKING:
    from onegpu.config import Config, Resolved
    from onegpu.training.resume import ResumePoint
    from onegpu.training.interrupt import GracefulStop
    from onegpu.training.recorder import StepRecorder

# train.backend -> the module that implements it (imported only when that backend trains).
REGISTRY = {"trainer": "onegpu.training.backends.hf_trainer",
            "accelerate": "onegpu.training.backends.accelerate"}


class Backend(Protocol):
    """What the training session calls (:func:`onegpu.training.session.run`)."""

    def train(self, model, tokenizer, dsd, cfg: "Config", resolved: "Resolved",
              sink: Callable[[dict, int], None], checkpoint_dir=None, stop: "GracefulStop | None" = None,
              resume: "ResumePoint | None" = None, checkpoint_meta: dict | None = None,
              oom_injector: Callable[[int, int], bool] | None = None) -> "tuple[object, StepRecorder]":
        """Fine-tune ``model`` on ``dsd['train']`` with the batch layout ``resolved``.

        Args:
            model: a float32 transformers model; tokenizer: its tokenizer (pads each micro-batch).
            dsd: the prepared ``DatasetDict``.
            sink: receives ``(metrics, step)`` once per optimizer step (:class:`StepRecorder`).
            checkpoint_dir: where ``checkpoint-N`` folders go every ``train.save_steps`` steps and on a
                stop (None: no checkpoints); checkpoint_meta: extra keys for ``onegpu_state.json``.
            stop: a requested stop ends training after the step in progress, with a checkpoint.
            resume: a checkpoint to continue from; its step rows, breakdown and events are restored.
            oom_injector: tests only: ``(step, rows) -> True`` raises an injected out-of-memory error.
        Returns:
            The trained model (``save_pretrained`` saves it) and the step recorder.
        Raises:
            onegpu.training.interrupt.Interrupted: a stop was requested (after the checkpoint is saved).
            onegpu.training.recorder.TrainingDiverged: a step's loss is not finite.
        """
        ...


def get(name: str) -> Backend:
    """The backend module registered as ``name`` (a ``train.backend`` value), imported now.

    Raises:
        KeyError: ``name`` is not in :data:`REGISTRY` (the config refuses such a name first).
    """
    return importlib.import_module(REGISTRY[name])
