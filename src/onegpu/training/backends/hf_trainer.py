"""The ``trainer`` backend: HF ``Trainer`` with ``TrainingArguments`` built from params.yaml's ``train``.

The loss is the exact mean over each optimizer step's effective batch (:mod:`onegpu.training.objectives.loss`),
passed as ``compute_loss_func`` so that Trainer counts the step's labels over all its micro-batches
(``num_items_in_batch``) and does not divide by the accumulation count again.

The Trainer callbacks that feed onegpu's backend-neutral :class:`~onegpu.training.record.recorder.StepRecorder`,
print its progress lines, add onegpu's checkpoint state and honour a requested stop live here too.
"""
from __future__ import annotations

import contextlib
import logging
import math
import tempfile

from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_callback import ProgressCallback

from onegpu import interpreter
from onegpu.config import TORCHAO_OPTIMIZERS, Config
from onegpu.measure import memory
from onegpu.training import around_steps, objectives, validation
from onegpu.training.backends.base import TrainRequest
from onegpu.training.lifecycle import oom
from onegpu.training.lifecycle.resume import complete
from onegpu.training.memory import checkpointing
from onegpu.training.objectives import loss_for
from onegpu.training.objectives.batches import own_micro_batches, rows_as_they_are
from onegpu.training.parallel import distributed, machines
from onegpu.training.record.recorder import BatchCounter, StepRecorder

# Whole-layer checkpointing through Trainer: transformers' current name is ``activation_checkpointing``
# (with ``every_n_layers`` in its kwargs). Earlier 5.x releases (5.17, say) have only
# ``gradient_checkpointing``, whose kwargs go to torch's checkpoint and cannot carry ``every_n_layers``:
# there Trainer's stays off and :func:`train` switches checkpointing on in the model itself, as it does
# for the attention/MLP granularities (the same recomputation either way).
TRAINER_CHECKPOINTS = "activation_checkpointing" in TrainingArguments.__dataclass_fields__


def trainer_checkpoints(train) -> bool:
    """Whether Trainer applies ``train``'s activation checkpointing (else the backend does, or none is on)."""
    return bool(train.gradient_checkpointing and checkpointing.is_default(train) and TRAINER_CHECKPOINTS)


# train.* keys that TrainingArguments takes under the same name and meaning.
SAME_NAME = ("learning_rate", "num_train_epochs", "max_steps", "lr_scheduler_type", "weight_decay", "optim",
             "max_grad_norm", "seed", "bf16", "fp16", "dataloader_num_workers")


def training_arguments(cfg: Config, output_dir: str) -> TrainingArguments:
    """``TrainingArguments`` from ``cfg.train`` (its batch layout in use, :class:`~onegpu.training.backends.
    base.TrainRequest`) under HF's own names.

    Fixed by onegpu: ``logging_steps=1`` (every optimizer step is logged to MLflow; ``train.logging_steps``
    only paces the terminal), ``report_to="none"`` (onegpu logs to MLflow itself), checkpoints only
    every ``train.save_steps`` (and on a requested stop; models/ gets the final model), no evaluation
    during training.
    ``train.warmup_ratio`` becomes ``warmup_steps`` (transformers 5 reads values below 1 as a ratio).
    ``train.gradient_checkpointing`` becomes ``activation_checkpointing`` (its current name) with
    ``train.gradient_checkpointing_kwargs`` (``use_reentrant``, ``every_n_layers``) as its kwargs; with
    ``gradient_checkpointing_blocks`` attention/mlp Trainer's is off and the backend wraps the sub-blocks
    (:mod:`onegpu.training.memory.checkpointing`); on a transformers without ``activation_checkpointing`` it is
    not passed at all (:data:`TRAINER_CHECKPOINTS`).
    ``train.tf32`` goes to TrainingArguments only with CUDA (there it is set either way, so that
    ``torch_compile`` does not switch TF32 on by itself); without CUDA it is a no-op and left None
    (TrainingArguments refuses ``tf32=True`` there). ``train.dataloader_pin_memory`` null = on with CUDA.
    ``train.torch_empty_cache_steps`` is not passed (Trainer would empty the cache on every micro-batch
    of such a step): :class:`EmptyCache` does it once per N optimizer steps, as the accelerate backend.
    """
    t = cfg.train
    cuda = memory.cuda_available()
    if t.optim in TORCHAO_OPTIMIZERS:  # Trainer's _get_torchao_optimizer asks transformers whether torchao is there
        interpreter.allow("torchao")
    return TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=t.per_device_train_batch_size,
        gradient_accumulation_steps=t.gradient_accumulation_steps,
        # blocks attention/mlp (or an older transformers): onegpu checkpoints itself (train()), Trainer nothing
        **({"activation_checkpointing": trainer_checkpoints(t),
            "activation_checkpointing_kwargs": checkpointing.hf_kwargs(t) if trainer_checkpoints(t) else None}
           if TRAINER_CHECKPOINTS else {}),
        **{name: getattr(t, name) for name in SAME_NAME},
        warmup_steps=t.warmup_ratio,
        data_seed=t.seed,
        dataloader_pin_memory=cuda if t.dataloader_pin_memory is None else t.dataloader_pin_memory,
        tf32=t.tf32 if cuda else None,
        torch_compile=t.torch_compile,
        torch_compile_mode=t.torch_compile_mode,
        use_cpu=not cuda,  # lets bf16 autocast run on a CPU (TrainingArguments refuses it otherwise)
        # Several processes (distributed.py): the step's item count summed over ranks and the loss scaled
        # by the number of processes (Trainer.compute_loss); NCCL/gloo collectives time out.
        average_tokens_across_devices=True,
        ddp_timeout=distributed.TIMEOUT_S,
        ddp_find_unused_parameters=False,  # every trainable parameter gets a gradient (no extra graph walk)
        logging_strategy="steps",
        logging_steps=1,
        logging_nan_inf_filter=False,
        save_strategy="steps" if t.save_steps else "no",
        save_steps=t.save_steps or 500,
        save_total_limit=None,  # CheckpointState removes the older checkpoint once the new one is complete
        save_on_each_node=machines.own_folders(),  # machines that keep checkpoints on their own disks
        eval_strategy="no",
        report_to="none",
        remove_unused_columns=False,
    )


class ExactLossTrainer(Trainer):
    """``Trainer`` whose loss is already normalised over the whole effective batch, that counts the
    examples and tokens it trains on (for throughput) without a host sync, and that survives an
    out-of-memory error in a step (``oom_retry``).

    Out-of-memory recovery: the failing micro-batch and every earlier micro-batch of the same
    optimizer step are redone, each cut into twice as many pieces as before, after the step's
    gradients are dropped; later steps keep the finer split. Because every piece's loss is divided by
    the whole step's item count, any split of the step gives the same gradient (float rounding aside):
    the run stays equivalent. Each event is kept in ``oom_events``.
    """

    loss_is_scaled_for_ga = True

    def __init__(self, *args, task: str = "sequence-classification", counter: BatchCounter | None = None,
                 oom_retry: bool = False, oom_injector=None, activation_offloading: bool = False, collate=None,
                 sampler=None, **kwargs):
        super().__init__(*args, compute_loss_func=loss_for(task), **kwargs)
        self.sampler = sampler  # the objective's (GRPO's groups); None: Trainer's RandomSampler
        # Several processes: the DataLoader hands rows uncollated; ``collate`` collates them (_own_batches)
        self.collate, self._epoch, self._next, self._pads, self._padding = collate, None, 0, set(), False
        # train.activation_offloading: each micro-batch's forward and backward in it, as SFTTrainer does
        self.offload = around_steps.offload_context(self.model, activation_offloading)
        self.task = task
        self.objective = objectives.get(task)
        self.counter = counter
        self.oom_retry = oom_retry
        self.oom_injector = oom_injector  # tests: (step, rows) -> True raises an injected OOM
        self.oom_events: list[dict] = []
        self.pieces = 1  # pieces per micro-batch (more after out-of-memory recoveries)
        self._step_inputs: list = []
        self._inputs_step = -1

    def _get_train_sampler(self, train_dataset=None):
        """The objective's sampler (:meth:`~onegpu.training.objectives.base.Objective.sampler`), else Trainer's."""
        return self.sampler if self.sampler is not None else super()._get_train_sampler(train_dataset)

    def _save_checkpoint(self, model, trial) -> None:
        """Trainer's checkpoint, a full disk said in one line naming the folder (:func:`onegpu.paths.writing`)."""
        import os

        from onegpu.paths import writing
        with writing(os.path.join(self.args.output_dir, f"checkpoint-{self.state.global_step}")):
            super()._save_checkpoint(model, trial)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """Trainer's prefetch of one optimizer step's micro-batches, with the step's item count taken by the
        objective's :meth:`~onegpu.training.objectives.base.Objective.count_batch` instead of Trainer's guess.

        Trainer decides whether to count causal-LM labels shifted from ``model.loss_type``; a GPT-2 in
        transformers 5.24 has ``loss_type`` None, so Trainer counts every label and each row's first
        token too: the step loss came out (targets / (targets + rows)) too small (1.6% at 64 tokens).
        Under several processes the count is summed over all ranks (as Trainer does with
        ``average_tokens_across_devices``, which then scales each rank's loss by the number of processes).
        """
        batch_samples, _ = super().get_batch_samples(epoch_iterator, num_batches, device)
        if self.collate is not None:
            batch_samples = self._own_batches(batch_samples, epoch_iterator, device)
        if batch_samples:  # the objective's own micro-batches of the step (GRPO: its generations)
            batch_samples = self.objective.step_batches(self.model, batch_samples, self.state.global_step + 1)
        if not batch_samples or "labels" not in batch_samples[0]:
            return batch_samples, None
        own = [b for b in batch_samples if id(b) not in self._pads]
        return batch_samples, around_steps.step_items(self.objective, own, device)

    def _own_batches(self, raw: list[list[dict]], epoch_iterator, device) -> list[dict]:
        """A step's uncollated micro-batches collated without accelerate's repeated rows
        (:func:`onegpu.training.objectives.batches.own_rows`), on ``device``; those with no row of their own are kept
        in ``_pads`` (their loss weighs 0). Which micro-batch of the epoch comes next is counted here: at an
        epoch's (or a resumed epoch's) first step from the optimizer steps done, as Trainer skips them."""
        args, accum, rows = self.args, self.args.gradient_accumulation_steps, len(self.train_dataset)
        if epoch_iterator is not self._epoch:
            per_rank = math.ceil(math.ceil(rows / args.per_device_train_batch_size) / args.world_size)
            self._epoch, self._next = epoch_iterator, (self.state.global_step % math.ceil(per_rank / accum)) * accum
        out, counted = own_micro_batches(raw, self._next, args.process_index, args.world_size,
                                         args.per_device_train_batch_size, rows, self.collate, device)
        self._next += len(raw)
        self._pads = {id(b) for b, own in zip(out, counted) if not own}
        return out

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self._padding:  # a micro-batch of repeated rows only (_own_batches): in step with the others, weighs 0
            loss = self.objective.pad_loss(model, inputs)
            return (loss, None) if return_outputs else loss
        if self.counter is not None and model.training:
            self.counter.add(inputs)
        if not self.objective.own_forward:
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)
        # The objective's forward and loss (a reference model beside the policy), scaled as Trainer.compute_loss
        # scales a compute_loss_func's under average_tokens_across_devices (DDP averages what the step sums).
        loss = self.objective.step_loss(model, inputs, num_items_in_batch)
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            loss = loss * self.accelerator.num_processes
        return (loss, None) if return_outputs else loss

    def training_step(self, model, inputs, num_items_in_batch=None):
        self._padding = id(inputs) in self._pads
        try:
            return self._retried_step(model, inputs, num_items_in_batch)
        finally:
            self._padding = False

    def _retried_step(self, model, inputs, num_items_in_batch):
        import torch
        if self.state.global_step != self._inputs_step:
            self._step_inputs, self._inputs_step = [], self.state.global_step
        self._step_inputs.append(inputs)
        while True:
            try:
                with self.offload:
                    return self._logged_in_its_dtype(self._pieces_step(model, inputs, num_items_in_batch))
            except torch.OutOfMemoryError as e:
                self._recover(model, inputs, e)
                try:
                    counter, self.counter = self.counter, None  # earlier pieces were counted already
                    for past in self._step_inputs[:-1]:
                        with self._no_sync(model), self.offload:  # as when they first ran: they only accumulate
                            self._pieces_step(model, past, num_items_in_batch)
                finally:
                    self.counter = counter

    def _logged_in_its_dtype(self, loss):
        """``loss``, with Trainer's running loss (``_tr_loss``, a float32 tensor it adds each micro-batch's
        loss into) in ``loss``'s dtype when that is wider: a float64 model's logged loss is not rounded to
        float32 (the same-training proofs compare it within 1e-12)."""
        running = getattr(self, "_tr_loss", None)
        if running is not None and running.dtype.itemsize < loss.dtype.itemsize:
            self._tr_loss = running.to(loss.dtype)
        return loss

    def _pieces_step(self, model, inputs, num_items_in_batch):
        if self.pieces == 1 and self.oom_injector is None:
            return super().training_step(model, inputs, num_items_in_batch)
        total = None
        parts = oom.cut(inputs, self.pieces, self.objective.sequences_per_item)
        for i, piece in enumerate(parts):
            oom.injected(self.oom_injector, self.state.global_step + 1, piece)
            # Under several processes only the last piece may all-reduce (if Trainer syncs this
            # micro-batch at all): every rank then syncs once, however it split its micro-batches.
            with self._no_sync(model) if i < len(parts) - 1 else contextlib.nullcontext():
                loss = super().training_step(model, piece, num_items_in_batch)
            total = loss if total is None else total + loss
        return total

    def _no_sync(self, model):
        """No gradient all-reduce in the block (DDP's ``no_sync``); a no-op on one process."""
        return self.accelerator.no_sync(model) if self.args.world_size > 1 else contextlib.nullcontext()

    def _recover(self, model, inputs, error) -> None:
        # the step's micro-batches are redone: their figures again
        self.pieces = around_steps.recover(error, model, [inputs], self.pieces, self.args.gradient_accumulation_steps,
                                           self.state.global_step + 1, self.oom_retry, self.oom_events, self.objective)


class CheckpointState(TrainerCallback):
    """After Trainer saves ``checkpoint-N``, add onegpu's state (step rows, breakdown, events, ``meta``)
    and then remove the older checkpoint (:func:`onegpu.training.lifecycle.resume.complete`; Trainer's own rotation,
    ``save_total_limit``, is off: it removes the older one before this state file is written)."""

    def __init__(self, recorder: StepRecorder, meta: dict) -> None:
        self.recorder, self.meta = recorder, meta

    def on_save(self, args, state, control, **kw):
        import os
        if not machines.writes_checkpoint():  # Trainer saved the checkpoint from rank 0 (or each machine's first)
            return
        complete(os.path.join(args.output_dir, f"checkpoint-{state.global_step}"), state.global_step,
                 self.recorder, self.meta)


class StepMetrics(TrainerCallback):
    """Feeds a :class:`StepRecorder` from HF Trainer's events (``logging_steps=1``).

    ``probe``: an optional ``(batch, loss_fn)`` whose activation bytes are measured at train begin,
    after Trainer has switched checkpointing on.
    """

    def __init__(self, recorder: StepRecorder, probe: tuple | None = None) -> None:
        self.recorder, self.probe = recorder, probe

    def on_train_begin(self, args, state, control, model=None, **kw):
        probe = self.probe if model is not None else None
        around_steps.begin(self.recorder, model, probe, next(model.parameters()).device if probe else None)

    def on_optimizer_step(self, args, state, control, model=None, optimizer=None, **kw):
        if model is not None:
            self.recorder.record_states(model, optimizer)

    def on_step_end(self, args, state, control, **kw):
        self.recorder.end_step(state.global_step)

    def on_log(self, args, state, control, logs=None, **kw):
        if logs and "loss" in logs:
            self.recorder.log(state.global_step, logs["loss"], logs.get("grad_norm"), logs.get("learning_rate"))
            if self.recorder.stopped_early:  # early stopping (onegpu.training.validation): Trainer ends here
                control.should_training_stop = True


class Validate(TrainerCallback):
    """Hands the recorder its :class:`onegpu.training.validation.Validation` when training begins (Trainer
    knows its step count then): onegpu's exact validation, in place of Trainer's own evaluation loop (off:
    :func:`training_arguments`), whose loss is a mean of batch means."""

    def __init__(self, recorder: StepRecorder, req: TrainRequest) -> None:
        self.recorder, self.req = recorder, req

    def on_train_begin(self, args, state, control, model=None, train_dataloader=None, **kw):
        _, per_epoch, _ = around_steps.schedule(len(train_dataloader), self.req.cfg)
        self.recorder.validation = validation.for_run(model, self.req.tokenizer, self.req.dsd, self.req.cfg,
                                                      args.device, state.max_steps, per_epoch,
                                                      self.req.checkpoint_dir)


class Progress(TrainerCallback):
    """onegpu's terminal progress for HF Trainer, in place of its progress bar and log dicts: the start line
    (:func:`onegpu.training.around_steps.announce`), then :func:`onegpu.training.around_steps.progress`'s lines.
    Added after :class:`StepMetrics`, so the step's row is recorded when ``on_log`` runs. ``rows``: the
    training examples."""

    def __init__(self, recorder: StepRecorder, cfg: Config, rows: int) -> None:
        self.recorder, self.cfg, self.rows = recorder, cfg, rows

    def on_train_begin(self, args, state, control, train_dataloader=None, **kw):
        t = self.cfg.train
        _, _, epochs = around_steps.schedule(len(train_dataloader), self.cfg)
        around_steps.announce(around_steps.Start(
            "trainer", state.max_steps, args.train_batch_size, args.gradient_accumulation_steps, args.world_size,
            self.rows, epochs, args.device, t.mixed_precision, t.logging_steps,
            objectives.of(self.cfg).start_words(self.cfg)), args.optim)

    def on_log(self, args, state, control, logs=None, **kw):
        step = state.global_step
        if not (logs and "loss" in logs) or not self.recorder.rows or self.recorder.rows[-1]["step"] != step:
            return
        around_steps.progress(self.recorder, step, state.max_steps, self.cfg.train.logging_steps)


class EmptyCache(TrainerCallback):
    """:func:`onegpu.training.around_steps.empty_cache` after each optimizer step (``train.torch_empty_cache_steps``,
    ``every``)."""

    def __init__(self, every: int) -> None:
        self.every = every

    def on_step_end(self, args, state, control, **kw):
        around_steps.empty_cache(state.global_step, self.every)


class StopCallback(TrainerCallback):
    """After a requested stop (:class:`onegpu.training.lifecycle.interrupt.GracefulStop`), save a checkpoint at the
    step's end and stop. Checked once the step is logged (added after :class:`StepMetrics`, whose
    ``on_log`` runs the step's validation pass): a stop requested during the pass stops after that step,
    with its point in the checkpoint, as the accelerate backend does; Trainer saves right after ``on_log``."""

    def __init__(self, stop) -> None:
        self.stop = stop

    def on_log(self, args, state, control, logs=None, **kw):
        if not logs or "loss" not in logs:  # a step's own log (every step, every rank: the collective below)
            return
        if around_steps.stop_requested(self.stop, args.world_size, args.device):
            control.should_save = True
            control.should_training_stop = True


class _OnlyTheSplit(logging.Filter):
    """Leaves out Trainer's warning that a checkpoint's ``per_device_train_batch_size`` differs from this run's
    (``transformers.trainer_utils.compare_trainer_and_checkpoint_args``) when that is all it says: onegpu resumes
    only a checkpoint of the same effective batch (the checkpoint folder's hash holds it), and the train stage's
    resume line says how the split changed. A warning naming another argument passes whole."""

    def filter(self, record: logging.LogRecord) -> bool:
        said = record.getMessage()
        return not (said.count("(from trainer_state.json)") == 1
                    and "\tper_device_train_batch_size:" in said)


@contextlib.contextmanager
def same_effective_batch_unsaid(resuming: bool):
    """While a resume trains: :class:`_OnlyTheSplit` on transformers' ``trainer_utils`` logger."""
    log, only = logging.getLogger("transformers.trainer_utils"), _OnlyTheSplit()
    if resuming:
        log.addFilter(only)
    try:
        yield
    finally:
        log.removeFilter(only)


def train(req: TrainRequest) -> tuple[object, StepRecorder]:
    """Fine-tune ``req.model`` on ``req.dsd['train']`` with HF ``Trainer``; the contract is
    :class:`onegpu.training.backends.base.Backend`.

    Checkpoints are Trainer's format (safetensors weights; optimizer, scheduler and RNG states loaded with
    ``weights_only=True``) plus onegpu's state file, written every ``train.save_steps`` steps and when
    ``req.stop`` is requested.
    """
    cfg, t, task, stop, resume = req.cfg, req.cfg.train, req.cfg.model.task, req.stop, req.resume
    scratch = None if req.checkpoint_dir else tempfile.TemporaryDirectory(prefix="onegpu-trainer-")
    out = str(req.checkpoint_dir) if req.checkpoint_dir else scratch.name  # scratch: removed when training ends
    args = training_arguments(cfg, out)
    around_steps.enable_checkpointing(req.model, t, by_framework=trainer_checkpoints(t))
    parts = objectives.training_parts(req.dsd, cfg, req.tokenizer)
    train_ds, collator = parts.rows, parts.collator
    several = args.world_size > 1  # rows uncollated: ExactLossTrainer leaves out accelerate's repeats, collates
    trainer = ExactLossTrainer(
        model=req.model, args=args, train_dataset=train_ds, data_collator=rows_as_they_are if several else collator,
        processing_class=req.tokenizer, task=task, oom_retry=t.oom_retry,
        oom_injector=req.oom_injector, activation_offloading=t.activation_offloading,
        collate=collator if several else None, sampler=objectives.of(cfg).sampler(train_ds, cfg))
    steps = around_steps.new_recorder(cfg, req.sink, args.device, trainer.model)
    trainer.counter, steps.events = steps.counter, trainer.oom_events
    if resume is not None:
        steps.restore(resume)
    if req.checkpoint_dir:
        trainer.add_callback(CheckpointState(steps, req.checkpoint_meta or {}))
    if t.torch_empty_cache_steps:
        trainer.add_callback(EmptyCache(t.torch_empty_cache_steps))
    trainer.add_callback(Validate(steps, req))
    trainer.add_callback(StepMetrics(steps, probe=around_steps.activation_probe(train_ds, collator, t, task)))
    if stop is not None:  # after StepMetrics: a stop is checked once the step's validation pass is over
        trainer.add_callback(StopCallback(stop))
    trainer.remove_callback(ProgressCallback)
    trainer.add_callback(Progress(steps, cfg, len(train_ds)))
    try:
        with same_effective_batch_unsaid(resume is not None):
            trainer.train(resume_from_checkpoint=resume.path if resume else None)
    finally:
        if scratch is not None:
            scratch.cleanup()
    stopped_by_other_rank = (args.world_size > 1 and trainer.state.global_step < trainer.state.max_steps
                             and not steps.stopped_early)
    if stop is not None and not steps.stopped_early and (stop.requested is not None or stopped_by_other_rank):
        raise around_steps.interruption(stop, trainer.state.global_step)
    return trainer.model, steps
