"""The ``trainer`` backend: HF ``Trainer`` with ``TrainingArguments`` built from params.yaml's ``train``.

The loss is the exact mean over each optimizer step's effective batch (:mod:`onegpu.training.loss`),
passed as ``compute_loss_func`` so that Trainer counts the step's labels over all its micro-batches
(``num_items_in_batch``) and does not divide by the accumulation count again.
"""
from __future__ import annotations

import tempfile
from typing import Callable

from transformers import DataCollatorWithPadding, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_callback import ProgressCallback

from onegpu.config import Config, Resolved
from onegpu.errors import UserError
from onegpu.training.checkpoint import write_state
from onegpu.training.callbacks import BatchCounter, Progress, StepMetrics, StepRecorder
from onegpu.training.loss import count_items, loss_for

# Columns the model consumes; prepare's other columns (text, length) are dropped before training.
MODEL_COLUMNS = ("input_ids", "attention_mask", "token_type_ids", "labels")


def training_arguments(cfg: Config, resolved: Resolved, output_dir: str) -> TrainingArguments:
    """``TrainingArguments`` from ``cfg.train`` under HF's own names.

    Fixed by onegpu: ``logging_steps=1`` (every optimizer step is logged to MLflow; ``train.logging_steps``
    only paces the terminal), ``report_to="none"`` (onegpu logs to MLflow itself), checkpoints only
    every ``train.save_steps`` (and on a requested stop; models/ gets the final model), no evaluation
    during training.
    ``train.warmup_ratio`` becomes ``warmup_steps`` (transformers 5 reads values below 1 as a ratio).
    ``train.gradient_checkpointing`` becomes ``activation_checkpointing`` (its current name) with
    non-reentrant checkpointing.
    """
    t = cfg.train
    return TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=resolved.per_device_train_batch_size,
        gradient_accumulation_steps=resolved.gradient_accumulation_steps,
        activation_checkpointing=t.gradient_checkpointing,
        activation_checkpointing_kwargs={"use_reentrant": False} if t.gradient_checkpointing else None,
        learning_rate=t.learning_rate,
        num_train_epochs=t.num_train_epochs,
        max_steps=t.max_steps,
        warmup_steps=t.warmup_ratio,
        lr_scheduler_type=t.lr_scheduler_type,
        weight_decay=t.weight_decay,
        optim=t.optim,
        max_grad_norm=t.max_grad_norm,
        seed=t.seed,
        data_seed=t.seed,
        bf16=t.bf16,
        fp16=t.fp16,
        dataloader_num_workers=t.dataloader_num_workers,
        dataloader_pin_memory=_cuda(),
        use_cpu=not _cuda(),  # lets bf16 autocast run on a CPU (TrainingArguments refuses it otherwise)
        logging_strategy="steps",
        logging_steps=1,
        logging_nan_inf_filter=False,
        save_strategy="steps" if t.save_steps else "no",
        save_steps=t.save_steps or 500,
        save_total_limit=1,
        eval_strategy="no",
        report_to="none",
        remove_unused_columns=False,
        per_device_eval_batch_size=cfg.evaluate.per_device_eval_batch_size,
    )


def _cuda() -> bool:
    import torch
    return torch.cuda.is_available()


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
                 oom_retry: bool = False, oom_injector=None, **kwargs):
        super().__init__(*args, compute_loss_func=loss_for(task), **kwargs)
        self.task = task
        self.counter = counter
        self.oom_retry = oom_retry
        self.oom_injector = oom_injector  # tests: (step, rows) -> True raises an injected OOM
        self.oom_events: list[dict] = []
        self.split = 1
        self._step_inputs: list = []
        self._inputs_step = -1

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """Trainer's prefetch of one optimizer step's micro-batches, with the step's item count taken by
        :func:`onegpu.training.loss.count_items` instead of Trainer's guess.

        Trainer decides whether to count causal-LM labels shifted from ``model.loss_type``; a GPT-2 in
        transformers 5.24 has ``loss_type`` None, so Trainer counts every label and each row's first
        token too: the step loss came out (targets / (targets + rows)) too small (1.6% at 64 tokens).
        """
        batch_samples, _ = super().get_batch_samples(epoch_iterator, num_batches, device)
        if not batch_samples or "labels" not in batch_samples[0]:
            return batch_samples, None
        num_items = sum(count_items(b["labels"], self.task) for b in batch_samples)
        return batch_samples, num_items.to(device)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.counter is not None and model.training:
            self.counter.add(inputs)
        return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                    num_items_in_batch=num_items_in_batch)

    def training_step(self, model, inputs, num_items_in_batch=None):
        import torch
        if self.state.global_step != self._inputs_step:
            self._step_inputs, self._inputs_step = [], self.state.global_step
        self._step_inputs.append(inputs)
        while True:
            try:
                return self._pieces_step(model, inputs, num_items_in_batch)
            except torch.OutOfMemoryError as e:
                self._recover(model, inputs, e)
                try:
                    counter, self.counter = self.counter, None  # earlier pieces were counted already
                    for past in self._step_inputs[:-1]:
                        self._pieces_step(model, past, num_items_in_batch)
                finally:
                    self.counter = counter

    def _pieces_step(self, model, inputs, num_items_in_batch):
        import torch
        rows = int(inputs["input_ids"].shape[0])
        if self.split == 1 and self.oom_injector is None:
            return super().training_step(model, inputs, num_items_in_batch)
        total = None
        for idx in torch.arange(rows).tensor_split(min(self.split, rows)):
            piece = {k: v[idx] if hasattr(v, "shape") and v.dim() > 0 and v.shape[0] == rows else v
                     for k, v in inputs.items()}
            if self.oom_injector is not None and self.oom_injector(self.state.global_step + 1, len(idx)):
                raise torch.OutOfMemoryError(f"injected out-of-memory (step {self.state.global_step + 1}, "
                                             f"{len(idx)} rows)")
            loss = super().training_step(model, piece, num_items_in_batch)
            total = loss if total is None else total + loss
        return total

    def _recover(self, model, inputs, error) -> None:
        import gc

        import torch
        micro = int(inputs["input_ids"].shape[0])
        step = self.state.global_step + 1
        if not self.oom_retry:
            raise error
        if self.split * 2 > micro:
            raise UserError(f"out of memory at optimizer step {step} even with micro-batch "
                            f"{max(1, micro // self.split)}: no smaller split is left; lower data.max_length, "
                            "turn train.gradient_checkpointing on, or use a smaller model") from error
        model.zero_grad(set_to_none=True)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        accum = self.args.gradient_accumulation_steps
        old = (micro // self.split, accum * self.split)
        self.split *= 2
        new = (micro // self.split, accum * self.split)
        self.oom_events.append({"step": step, "old": f"{old[0]} x {old[1]}", "new": f"{new[0]} x {new[1]}",
                                "micro_batch": new[0]})
        print(f"out of memory at optimizer step {step}: redoing the step with micro-batch {new[0]} x "
              f"{new[1]} accumulation (was {old[0]} x {old[1]}); same effective batch, same result")


def model_inputs(dsd, task: str = "sequence-classification"):
    """The prepared dataset(s) reduced to the model's columns.

    Classification: ``label`` renamed ``labels``. Causal LM: the label column is dropped (the collator
    makes token labels). Works on a ``DatasetDict`` or a single ``Dataset``.
    """
    if task == "causal-lm":
        dsd = dsd.remove_columns("label")
    else:
        dsd = dsd.rename_column("label", "labels")
    cols = dsd.column_names if hasattr(dsd, "features") else dsd["train"].column_names
    return dsd.remove_columns([c for c in cols if c not in MODEL_COLUMNS])


class CausalLMCollator:
    """Pads a micro-batch to its longest row; ``labels`` = ``input_ids`` with -100 at padding.

    Unlike ``DataCollatorForLanguageModeling``, it never masks a real EOS token when pad == EOS.
    Labels are unshifted: the loss shifts them (:func:`onegpu.training.loss.causal_lm_loss`).
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def __call__(self, features: list[dict]) -> dict:
        batch = self.tokenizer.pad(features, return_tensors="pt")
        labels = batch["input_ids"].clone()
        labels[batch["attention_mask"] == 0] = -100
        batch["labels"] = labels
        return batch


def collator_for(task: str, tokenizer):
    """The micro-batch collator for ``task`` (padding per micro-batch)."""
    return CausalLMCollator(tokenizer) if task == "causal-lm" else DataCollatorWithPadding(tokenizer)


def probe_batch(train_ds, collator, resolved: Resolved) -> dict:
    """One micro-batch for the activation probe: the first ``per_device_train_batch_size`` rows.

    Taken by index, not from the training DataLoader, so the sampler's RNG is untouched.
    """
    n = min(resolved.per_device_train_batch_size, len(train_ds))
    return collator([train_ds[i] for i in range(n)])


class CheckpointState(TrainerCallback):
    """After Trainer saves ``checkpoint-N``, add onegpu's state (step rows, breakdown, events, ``meta``)."""

    def __init__(self, recorder: StepRecorder, meta: dict) -> None:
        self.recorder, self.meta = recorder, meta

    def on_save(self, args, state, control, **kw):
        import os
        write_state(os.path.join(args.output_dir, f"checkpoint-{state.global_step}"), state.global_step,
                    self.recorder, self.meta)


def train(model, tokenizer, dsd, cfg: Config, resolved: Resolved,
          sink: Callable[[dict, int], None], oom_injector=None, checkpoint_dir=None, stop=None,
          resume: tuple[str, dict] | None = None, checkpoint_meta: dict | None = None
          ) -> tuple[object, StepRecorder]:
    """Fine-tune ``model`` on ``dsd['train']``; per-step metrics go to ``sink(metrics, step)``.

    Checkpoints (Trainer's format: safetensors weights; optimizer, scheduler and RNG states loaded with
    ``weights_only=True``) go to ``checkpoint_dir`` every ``train.save_steps`` steps and when ``stop``
    (a :class:`onegpu.training.interrupt.GracefulStop`) is requested; ``resume`` =
    :func:`onegpu.training.checkpoint.latest_checkpoint`'s answer continues from one, with the earlier step rows restored.

    Returns:
        The trained model (``save_pretrained`` saves it) and the step recorder (rows and summary).
    Raises:
        onegpu.training.interrupt.Interrupted: a stop was requested (after the checkpoint is saved).
    """
    from onegpu.training.interrupt import Interrupted, StopCallback
    counter = BatchCounter()
    scratch = None if checkpoint_dir else tempfile.TemporaryDirectory(prefix="onegpu-trainer-")
    out = str(checkpoint_dir) if checkpoint_dir else scratch.name  # scratch: removed when training ends
    args = training_arguments(cfg, resolved, out)
    train_ds = model_inputs(dsd, cfg.model.task)["train"]
    collator = collator_for(cfg.model.task, tokenizer)
    trainer = ExactLossTrainer(
        model=model, args=args, train_dataset=train_ds, data_collator=collator, processing_class=tokenizer,
        counter=counter, task=cfg.model.task, oom_retry=cfg.train.oom_retry, oom_injector=oom_injector)
    steps = StepRecorder(sink, args.device, counter)
    steps.events = trainer.oom_events
    if resume is not None:
        steps.rows = list(resume[1]["rows"])
        steps.breakdown.update(resume[1].get("breakdown", {}))
        steps.events.extend(resume[1].get("events", []))
    if checkpoint_dir:
        trainer.add_callback(CheckpointState(steps, checkpoint_meta or {}))
    if stop is not None:
        trainer.add_callback(StopCallback(stop))
    trainer.add_callback(StepMetrics(steps, probe=(probe_batch(train_ds, collator, resolved),
                                                   loss_for(cfg.model.task))))
    trainer.remove_callback(ProgressCallback)
    trainer.add_callback(Progress(steps, cfg.train.logging_steps))
    try:
        trainer.train(resume_from_checkpoint=resume[0] if resume else None)
    finally:
        if scratch is not None:
            scratch.cleanup()
    if stop is not None and stop.requested is not None:
        raise Interrupted(stop.requested, trainer.state.global_step)
    return trainer.model, steps


def predict(model, tokenizer, dataset, cfg: Config):
    """Run ``model`` over ``dataset`` (prepared columns) and return HF's ``PredictionOutput``.

    Its ``metrics`` hold ``eval_loss`` (mean per example), ``eval_runtime`` (seconds),
    ``eval_samples_per_second``; ``predictions`` are logits ``(rows, num_labels)``.
    """
    with tempfile.TemporaryDirectory(prefix="onegpu-eval-") as out:  # Trainer wants one; nothing is saved
        args = TrainingArguments(output_dir=out, per_device_eval_batch_size=cfg.evaluate.per_device_eval_batch_size,
                                 report_to="none", remove_unused_columns=False, bf16_full_eval=False,
                                 disable_tqdm=True, dataloader_pin_memory=_cuda())
        ds = model_inputs(dataset)
        trainer = ExactLossTrainer(model=model, args=args, data_collator=DataCollatorWithPadding(tokenizer),
                                   processing_class=tokenizer)
        return trainer.predict(ds, metric_key_prefix="eval")
