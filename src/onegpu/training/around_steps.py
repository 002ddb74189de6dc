"""What a training does around its optimizer steps, whatever the backend: written once, called by both.

The ``trainer`` backend (:mod:`onegpu.training.backends.hf_trainer`) calls these from its ``Trainer``
subclass and thin callbacks, the ``accelerate`` backend (:mod:`onegpu.training.backends.accelerate`) from its
loop: the step count (Trainer's), the recorder with the objective's figures, the start line, activation
checkpointing, the offload context, the activation probe, the step's item count over the ranks, out-of-memory
recovery, the progress line, emptying the cache and a stop decided over the ranks. What differs between the
backends (how a step runs, how a checkpoint is written and loaded) stays in each; a change to how the ranks
work together (sharding, say) changes the shared part here once.

Host-device syncs: none here per micro-batch; :func:`stop_requested` is one small all-reduce per step under
several processes.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from onegpu.config import Config
from onegpu.measure import memory
from onegpu.training import objectives
from onegpu.training.lifecycle import oom
from onegpu.training.lifecycle.interrupt import Interrupted
from onegpu.training.memory import activation_offloading, checkpointing
from onegpu.training.objectives import loss_for
from onegpu.training.objectives.batches import probe_batch
from onegpu.training.parallel import distributed
from onegpu.training.record.recorder import BatchCounter, StepRecorder, first_step_note, progress_line


def schedule(len_dataloader: int, cfg: Config) -> tuple[int, int, int]:
    """(optimizer steps in all, optimizer steps per epoch, epochs to iterate), as Trainer counts them.

    Source: ``Trainer.set_initial_training_values``. ``len_dataloader`` = micro-batches per epoch (the last
    may be short). An epoch's last optimizer step takes the leftover micro-batches, so an epoch has
    ``ceil(len_dataloader / accumulation)`` steps. ``max_steps > 0`` wins over ``num_train_epochs``
    (the last epoch is cut short); otherwise ``ceil(num_train_epochs * steps per epoch)`` steps.
    """
    t = cfg.train
    per_epoch = max(math.ceil(len_dataloader / t.gradient_accumulation_steps), 1)
    if t.max_steps > 0:
        return t.max_steps, per_epoch, math.ceil(t.max_steps / per_epoch)
    return math.ceil(t.num_train_epochs * per_epoch), per_epoch, math.ceil(t.num_train_epochs)


def new_recorder(cfg: Config, sink: Callable[[dict, int], None], device, model) -> StepRecorder:
    """The run's :class:`~onegpu.training.record.recorder.StepRecorder` on ``device``: its counter counts the
    objective's sequences per item, it takes the objective's per-step figures of ``model`` (DPO's rewards) and
    its memory breakdown starts with the objective's own terms (DPO's reference model)."""
    objective = objectives.of(cfg)
    recorder = StepRecorder(sink, device, BatchCounter(objective.sequences_per_item))
    recorder.figures = objective.step_figures(model)
    recorder.tables = objective.run_tables(model)  # (live: the checkpoints keep them, a resume refills them)
    recorder.breakdown.update(objective.memory_terms(model))
    return recorder


@dataclass(frozen=True)
class Start:
    """What the start line says (:meth:`line`), as each backend knows it before its first step.

    Attributes:
        backend: ``train.backend``; steps: optimizer steps in all; micro: examples per micro-batch per process;
        accum: micro-batches per optimizer step; world: processes; rows: training examples; epochs: epochs
        iterated (:func:`schedule`); device: this process's device; mixed_precision: ``"bf16"``, ``"fp16"`` or
        ``"no"``; every: progress lines every that many steps (``train.logging_steps``).
    """
    backend: str
    steps: int
    micro: int
    accum: int
    world: int
    rows: int
    epochs: int
    device: object
    mixed_precision: str
    every: int
    words: tuple[str, str] = ("examples", "training examples")  # the objective's (Objective.start_words)

    def line(self) -> str:
        """The terminal line before the first step, one wording for both backends.

        Example: ``train: 12 optimizer steps of 16 examples (4 x 2 x 2 processes), 64 training examples in 3
        epoch(s); the accelerate backend on cpu, mixed precision no; progress every 10 steps, every step goes
        to MLflow``.
        """
        procs = f" x {self.world} processes" if self.world > 1 else ""
        items, rows = self.words
        return (f"train: {self.steps} optimizer steps of {self.micro * self.accum * self.world} {items} "
                f"({self.micro} x {self.accum}{procs}), {self.rows} {rows} in {self.epochs} epoch(s); "
                f"the {self.backend} backend on {self.device}, mixed precision {self.mixed_precision}; "
                f"progress every {self.every} steps, every step goes to MLflow")


def announce(start: Start, optim) -> None:
    """Print (rank 0) ``start``'s line and, for an optimizer that compiles its first step (``optim``:
    ``train.optim``, or transformers' ``OptimizerNames`` member),
    :func:`~onegpu.training.record.recorder.first_step_note`."""
    distributed.print_main(start.line())
    if note := first_step_note(optim):
        distributed.print_main(note)


def enable_checkpointing(model, t, by_framework: bool = False) -> None:
    """Switch ``t.gradient_checkpointing``'s activation checkpointing on in ``model``
    (:func:`onegpu.training.memory.checkpointing.enable`), unless it is off or ``by_framework``: the backend's
    framework switches it on itself (Trainer's ``activation_checkpointing``).

    Raises:
        ModelError: a sub-block granularity on an architecture without those sub-blocks.
    """
    if t.gradient_checkpointing and not by_framework:
        checkpointing.enable(model, t)


def offload_context(model, enabled: bool):
    """The context each micro-batch's forward and backward run in: ``train.activation_offloading``'s
    (:func:`onegpu.training.memory.activation_offloading.context`, reusable across steps) for ``model`` when
    ``enabled``, else a no-op."""
    return activation_offloading.context(model, enabled)


def activation_probe(rows, collator, t, task: str) -> tuple[dict, Callable] | None:
    """``(batch, loss_fn)`` for :func:`begin`: the first micro-batch of ``rows`` collated by ``collator``
    (:func:`onegpu.training.objectives.batches.probe_batch`, the sampler's RNG untouched) and ``task``'s loss;
    None where the objective's rows are not what a micro-batch trains on (GRPO's prompt indices)."""
    if not objectives.get(task).probes_activations:
        return None
    return probe_batch(rows, collator, t.per_device_train_batch_size), loss_for(task)


def begin(recorder: StepRecorder, model, probe: tuple | None, device) -> None:
    """Right before the first step: the activation bytes of ``probe`` (``(batch, loss_fn)`` from
    :func:`activation_probe`, its batch moved to ``device``; None: no probe) measured on ``model`` once its
    checkpointing is on, then the recorder's clock started."""
    if probe is not None:
        batch, loss_fn = probe
        recorder.probe_activations(model, {k: v.to(device) for k, v in batch.items()}, loss_fn)
    recorder.start()


def step_items(objective, batches: list[dict], device):
    """The optimizer step's item count over all ranks (a 0-d int64 tensor on ``device``, not synced to the
    host): ``objective.count_batch`` over this rank's own micro-batches ``batches`` (not accelerate's repeats),
    summed over the ranks, so each rank's loss is its share of the whole step's mean."""
    import torch
    mine = sum((objective.count_batch(b) for b in batches), torch.zeros((), dtype=torch.int64, device=device))
    return distributed.sum_over_ranks(mine.to(device))


def recover(error, model, batches: list[dict], pieces: int, accum: int, step: int, retry: bool,
            events: list[dict], objective) -> int:
    """After out-of-memory ``error`` at optimizer step ``step`` (``batches``: the micro-batches redone, each cut in
    ``pieces`` pieces; ``accum``: the accumulation): :func:`onegpu.training.lifecycle.oom.recover` (gradients dropped,
    cache freed, the event appended to ``events``) and ``objective``'s step restarted (its per-step figures again).
    Returns the next number of pieces per micro-batch.

    Raises:
        torch.OutOfMemoryError: ``retry`` (``train.oom_retry``) is off (``error`` itself).
        UserError: the micro-batch cannot be cut further.
    """
    rows = max(oom.rows(b) for b in batches)
    pieces = oom.recover(error, model, rows, pieces, accum, step, retry, events)
    objective.restart_step(model)
    return pieces


def progress(recorder: StepRecorder, step: int, total: int, every: int) -> None:
    """After step ``step`` of ``total`` is logged: its progress line
    (:func:`~onegpu.training.record.recorder.progress_line`, rank 0) every ``every`` steps and at the last."""
    if step % every == 0 or step == total:
        distributed.print_main(progress_line(step, total, recorder.rows, recorder.device, recorder.evals))


def empty_cache(step: int, every: int) -> bool:
    """After optimizer step ``step``: empty the allocator's cache (``train.torch_empty_cache_steps``,
    ``every``; 0 or None: never) every ``every``-th step. Returns whether it did."""
    if not every or step % every:
        return False
    memory.empty_cache()
    return True


def stop_requested(stop, world: int, device) -> bool:
    """Whether a stop was requested (``stop``: a :class:`~onegpu.training.lifecycle.interrupt.GracefulStop`, or None)
    on this rank or, under several processes (``world``), on any rank: all stop after the same step. Under
    several processes every rank must call it at the same point (one all-reduce on ``device``)."""
    requested = stop is not None and stop.requested is not None
    if world > 1:
        requested = distributed.any_rank(requested, device)
    return requested


def interruption(stop, step: int) -> Interrupted:
    """The :class:`~onegpu.training.lifecycle.interrupt.Interrupted` to raise after optimizer step ``step`` for a stop
    :func:`stop_requested` found: this rank's signal, or SIGTERM (15) where another rank's stop ended it."""
    return Interrupted(getattr(stop, "requested", None) or 15, step)
