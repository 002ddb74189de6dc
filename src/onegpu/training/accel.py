"""The ``accelerate`` backend: a plain training loop on 🤗 Accelerate (in the style of nanoGPT's train.py).

It trains the same way as the ``trainer`` backend (:mod:`onegpu.training.hf_trainer`), so that on the same
params both give the same per-step losses: the same data order (a ``RandomSampler`` reseeded with
``train.seed + epoch`` each epoch), collator, optimizer with weight-decay groups, scheduler and warmup,
gradient clipping, number of optimizer steps, and the exact loss over each effective batch
(:mod:`onegpu.training.loss`). Where a line copies the behaviour of HF ``Trainer``, the comment names the
place in ``transformers/trainer.py`` (transformers 5.24).

Gradient accumulation is driven here, not by ``accelerator.accumulate``: an optimizer step prefetches its
micro-batches (to count the step's items before the first forward), its last step in an epoch may hold
fewer micro-batches than ``gradient_accumulation_steps``, and its loss is already normalised over the
whole step. ``accumulate()`` counts micro-batches modulo a fixed number and ``Accelerator.backward``
divides the loss by that number again; so, like Trainer (``create_accelerator_and_postprocess``: "GAS=1
in Accelerate to avoid any double-division"), Accelerate's accumulation count stays 1 and gradients are
all-reduced (under DDP) only on the step's last micro-batch, via ``accelerator.no_sync``.

Host-device syncs: one per optimizer step (the loss, grad norm and token count read at the step's end),
none per micro-batch.
"""
from __future__ import annotations

import contextlib
import itertools
import math
from functools import partial
from typing import Callable

from onegpu.config import Config, Resolved
from onegpu.training.callbacks import BatchCounter, StepRecorder, progress_line
from onegpu.training.checkpoint import load_loop_state, load_rng, save_loop_state
from onegpu.training.interrupt import Interrupted
from onegpu.training.hf_trainer import collator_for, model_inputs, probe_batch
from onegpu.training.loss import count_items, loss_for

# Parameter names that get no weight decay: Trainer.get_decay_parameter_names (transformers/trainer.py).
NO_DECAY_PATTERNS = [r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"]


def mixed_precision(cfg: Config) -> str:
    """Accelerate's ``mixed_precision`` for ``train.bf16`` / ``train.fp16``: "bf16", "fp16" or "no"."""
    return "bf16" if cfg.train.bf16 else "fp16" if cfg.train.fp16 else "no"


def param_groups(model, weight_decay: float) -> list[dict]:
    """Two optimizer parameter groups as Trainer builds them (``Trainer.create_optimizer``).

    Decay (``weight_decay``): every trainable parameter except biases, norm weights and parameters inside
    ``nn.LayerNorm`` modules (``Trainer.get_decay_parameter_names``); no decay (0.0): those.
    """
    from torch import nn
    from transformers.trainer_pt_utils import get_parameter_names
    decay = set(get_parameter_names(model, [nn.LayerNorm], NO_DECAY_PATTERNS))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [{"params": [p for n, p in named if n in decay], "weight_decay": weight_decay},
            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]


def make_optimizer(model, cfg: Config):
    """The optimizer ``train.optim`` names, with Trainer's defaults for it.

    Source: ``transformers/trainer_optimizer.py`` (``_get_adamw_torch``, ``_get_sgd``, ``_get_adagrad``,
    ``_get_rmsprop``, ``_get_adafactor``) with ``TrainingArguments``' defaults: AdamW betas (0.9, 0.999),
    eps 1e-8; the others take torch's defaults and only ``lr``.
    """
    import torch
    t = cfg.train
    groups = param_groups(model, t.weight_decay)
    if t.optim in ("adamw_torch", "adamw_torch_fused"):
        fused = {"fused": True} if t.optim == "adamw_torch_fused" else {}
        return torch.optim.AdamW(groups, lr=t.learning_rate, betas=(0.9, 0.999), eps=1e-8, **fused)
    if t.optim == "sgd":
        return torch.optim.SGD(groups, lr=t.learning_rate)
    if t.optim == "adagrad":
        return torch.optim.Adagrad(groups, lr=t.learning_rate)
    if t.optim == "rmsprop":
        return torch.optim.RMSprop(groups, lr=t.learning_rate)
    if t.optim == "adafactor":
        from transformers.optimization import Adafactor
        return Adafactor(groups, lr=t.learning_rate, scale_parameter=False, relative_step=False)
    raise ValueError(f"train.optim={t.optim!r} is not supported by the accelerate backend")


def schedule(len_dataloader: int, cfg: Config, resolved: Resolved) -> tuple[int, int, int]:
    """(optimizer steps in all, optimizer steps per epoch, epochs to iterate), as Trainer counts them.

    Source: ``Trainer.set_initial_training_values``. ``len_dataloader`` = micro-batches per epoch (the last
    may be short). An epoch's last optimizer step takes the leftover micro-batches, so an epoch has
    ``ceil(len_dataloader / accumulation)`` steps. ``max_steps > 0`` wins over ``num_train_epochs``
    (the last epoch is cut short); otherwise ``ceil(num_train_epochs * steps per epoch)`` steps.
    """
    accum = resolved.gradient_accumulation_steps
    per_epoch = max(math.ceil(len_dataloader / accum), 1)
    t = cfg.train
    if t.max_steps > 0:
        return t.max_steps, per_epoch, math.ceil(t.max_steps / per_epoch)
    return math.ceil(t.num_train_epochs * per_epoch), per_epoch, math.ceil(t.num_train_epochs)


def _forward_backward(accelerator, model, micro_batches: list[dict], num_items, loss_fn, split: int,
                      oom_injector, step: int):
    """Forward and backward over one optimizer step's micro-batches, each cut into ``split`` pieces.

    Returns the step's loss (a 0-d tensor on the device, not synced): the sum of the pieces' losses,
    each already divided by the step's item count ``num_items``. Gradients are all-reduced (under DDP)
    only after the last piece (``accelerator.no_sync`` before). ``labels`` stay in the inputs.
    Raises:
        torch.OutOfMemoryError: a piece did not fit (or ``oom_injector`` said so).
    """
    import torch
    pieces = []
    for inputs in micro_batches:
        rows = int(inputs["input_ids"].shape[0])
        for idx in torch.arange(rows).tensor_split(min(split, rows)):
            pieces.append({k: v[idx] if hasattr(v, "shape") and v.dim() > 0 and v.shape[0] == rows else v
                           for k, v in inputs.items()} if split > 1 else inputs)
    step_loss = torch.zeros((), device=accelerator.device)
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        accelerator.sync_gradients = last  # as Trainer sets it; the optimizer steps only when True
        if oom_injector is not None and oom_injector(step, int(piece["input_ids"].shape[0])):
            raise torch.OutOfMemoryError(f"injected out-of-memory (step {step}, "
                                         f"{int(piece['input_ids'].shape[0])} rows)")
        features = {k: v for k, v in piece.items() if k != "labels"}
        with contextlib.nullcontext() if last else accelerator.no_sync(model):
            loss = loss_fn(model(**features), piece["labels"], num_items)  # this piece's share of the mean
            accelerator.backward(loss)  # no division: Accelerate's accumulation count is 1
        step_loss += loss.detach()
    return step_loss


def _recover(error, model, micro_batches: list[dict], split: int, accum: int, step: int, enabled: bool,
             events: list[dict]) -> int:
    """After an out-of-memory error: drop the step's gradients, free cached memory and return the next
    split (twice as many pieces per micro-batch). The event is appended to ``events`` and printed.

    Raises:
        torch.OutOfMemoryError: ``train.oom_retry`` is false (the error itself).
        UserError: a micro-batch cannot be cut further (its pieces are one row already).
    """
    import gc

    import torch

    from onegpu.errors import UserError
    micro = max(int(b["input_ids"].shape[0]) for b in micro_batches)
    if not enabled:
        raise error
    if split * 2 > micro:
        raise UserError(f"out of memory at optimizer step {step} even with micro-batch {max(1, micro // split)}: "
                        "no smaller split is left; lower data.max_length, turn train.gradient_checkpointing on, "
                        "or use a smaller model") from error
    model.zero_grad(set_to_none=True)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    old, new = (micro // split, accum * split), (micro // (split * 2), accum * split * 2)
    events.append({"step": step, "old": f"{old[0]} x {old[1]}", "new": f"{new[0]} x {new[1]}",
                   "micro_batch": new[0]})
    print(f"out of memory at optimizer step {step}: redoing the step with micro-batch {new[0]} x {new[1]} "
          f"accumulation (was {old[0]} x {old[1]}); same effective batch, same result", flush=True)
    return split * 2


def train(model, tokenizer, dsd, cfg: Config, resolved: Resolved,
          sink: Callable[[dict, int], None], checkpoint_dir=None, stop=None,
          resume: tuple[str, dict] | None = None, checkpoint_meta: dict | None = None,
          oom_injector=None) -> tuple[object, StepRecorder]:
    """Fine-tune ``model`` on ``dsd['train']``; per-step metrics go to ``sink(metrics, step)``.

    Args:
        model: a transformers model (float32), e.g. ``AutoModelForSequenceClassification``.
        tokenizer: its tokenizer (pads each micro-batch to its longest row).
        dsd: the prepared ``DatasetDict`` (``train`` with ``input_ids``, ``attention_mask``, ``label``...).
        cfg, resolved: the validated params and the batch layout (micro-batch x accumulation).
        sink: receives one dict of metrics per optimizer step (see :class:`StepRecorder`).
        checkpoint_dir, stop, resume, checkpoint_meta: as for :func:`onegpu.training.hf_trainer.train`;
            checkpoints are :func:`onegpu.training.checkpoint.save_loop_state`'s.
        oom_injector: tests only: ``(step, rows) -> bool``; True raises an injected out-of-memory error
            before that piece's forward pass.
    Out-of-memory recovery (``train.oom_retry``, as the ``trainer`` backend): the step's gradients are
    dropped and all its micro-batches are redone, each cut into twice as many pieces; later steps keep
    the finer split. Every piece's loss is divided by the whole step's item count, so the step's
    gradient is the same (float rounding aside). Events go to the recorder's ``events``.
    Returns:
        The trained model, unwrapped from Accelerate (``save_pretrained`` saves it), and the step recorder
        (one row per optimizer step: loss = the step's exact mean loss, grad_norm = total L2 norm before
        clipping, learning_rate = the rate that step used, times and throughput).
    """
    import torch
    from accelerate import Accelerator, DataLoaderConfiguration
    from torch.utils.data import DataLoader, RandomSampler
    from transformers import get_scheduler, set_seed
    from transformers.trainer_utils import align_special_tokens, seed_worker

    t = cfg.train
    micro, accum = resolved.per_device_train_batch_size, resolved.gradient_accumulation_steps
    set_seed(t.seed)  # Trainer.__init__ seeds again after the model is built (dropout draws from here)

    # Data order as Trainer's: a RandomSampler that Accelerate replaces by its SeedableRandomSampler,
    # reseeded with data_seed + epoch at each epoch (transformers' AcceleratorConfig has
    # use_seedable_sampler=True; hf_trainer sets data_seed = train.seed; accelerate/data_loader.py).
    accelerator = Accelerator(
        mixed_precision=mixed_precision(cfg),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=t.seed))
    device = accelerator.device
    train_set = model_inputs(dsd, cfg.model.task)["train"]
    loader = DataLoader(
        train_set, batch_size=micro, sampler=RandomSampler(train_set), drop_last=False,
        collate_fn=collator_for(cfg.model.task, tokenizer), num_workers=t.dataloader_num_workers,
        pin_memory=torch.cuda.is_available(),
        worker_init_fn=partial(seed_worker, num_workers=t.dataloader_num_workers,
                               rank=accelerator.process_index))

    # Model: as Trainer does (__init__ sets config.use_cache = TrainingArguments.use_cache, False;
    # Trainer.train enables checkpointing and aligns special tokens before its loop).
    if getattr(model, "config", None) is not None:
        model.config.use_cache = False
    if t.gradient_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    align_special_tokens(model, tokenizer)

    optimizer = make_optimizer(model, cfg)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    # The scheduler is not prepared (neither is Trainer's): Accelerate would step it once per process.
    total_steps, steps_per_epoch, epochs = schedule(len(loader), cfg, resolved)
    warmup = math.ceil(total_steps * t.warmup_ratio)  # TrainingArguments.get_warmup_steps for a ratio < 1
    scheduler = get_scheduler(t.lr_scheduler_type, optimizer=optimizer, num_warmup_steps=warmup,
                              num_training_steps=total_steps)
    plateau = isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)  # stepped by eval only
    loss_fn = loss_for(cfg.model.task)

    counter = BatchCounter()
    recorder = StepRecorder(sink, device, counter)
    print(f"accelerate: {total_steps} optimizer steps of {resolved.effective_batch_size} examples "
          f"({micro} x {accum}), {len(train_set)} examples, {epochs} epoch(s), {accelerator.device}, "
          f"mixed precision {accelerator.mixed_precision}", flush=True)

    start, split = 0, 1  # split: pieces per micro-batch after out-of-memory recoveries
    if resume is not None:  # weights, optimizer, scheduler; the data position and RNG below
        load_loop_state(resume[0], accelerator.unwrap_model(model), optimizer, scheduler)
        start = int(resume[1]["step"])
        recorder.rows = list(resume[1]["rows"])
        recorder.breakdown.update(resume[1].get("breakdown", {}))
        recorder.events.extend(resume[1].get("events", []))
        print(f"accelerate: resuming after optimizer step {start}", flush=True)

    model.train()
    optimizer.zero_grad(set_to_none=True)
    probe = probe_batch(train_set, collator_for(cfg.model.task, tokenizer), resolved)
    recorder.probe_activations(model, {k: v.to(device) for k, v in probe.items()}, loss_fn)
    recorder.start()
    step = start
    first_epoch, first_update = divmod(start, steps_per_epoch)
    for epoch in range(first_epoch, epochs):
        loader.set_epoch(epoch)
        skip = first_update if epoch == first_epoch else 0
        # A resumed epoch draws the same order (the sampler is seeded per epoch) and skips what was done.
        batches = iter(accelerator.skip_first_batches(loader, skip * accum) if skip else loader)
        for update in range(skip, steps_per_epoch):
            # Prefetch the step's micro-batches and count its items (Trainer.get_batch_samples); the
            # epoch's last step takes what is left.
            n = accum if update < steps_per_epoch - 1 else (len(loader) % accum or accum)
            micro_batches = list(itertools.islice(batches, n))
            if resume is not None and step == start:
                # Only now: a fresh DataLoader iterator draws its base seed from the global RNG at its
                # first batch, which the uninterrupted run did before step 1. Dropout then matches.
                load_rng(resume[0])
            num_items = sum(count_items(b["labels"], cfg.model.task) for b in micro_batches)

            while True:  # more than once only after an out-of-memory error (train.oom_retry)
                try:
                    step_loss = _forward_backward(accelerator, model, micro_batches, num_items, loss_fn,
                                                  split, oom_injector, step + 1)
                    break
                except torch.OutOfMemoryError as e:
                    split = _recover(e, model, micro_batches, split, accum, step + 1, t.oom_retry,
                                     recorder.events)
            for inputs in micro_batches:  # counted once, whatever the split
                counter.add(inputs)

            # Norm before clipping; with max_grad_norm 0 an infinite bound only measures it
            # (Trainer._clip_grad_norm / _get_grad_norm).
            grad_norm = accelerator.clip_grad_norm_(model.parameters(), t.max_grad_norm or float("inf"))
            optimizer.step()
            recorder.record_states(model, optimizer)  # once: grads and optimizer states exist now
            lr = optimizer.param_groups[0]["lr"] if plateau else scheduler.get_last_lr()[0]
            if not accelerator.optimizer_step_was_skipped and not plateau:  # fp16 skips steps with inf grads
                scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            recorder.end_step(step)

            values = torch.stack([step_loss.float(), torch.as_tensor(grad_norm, device=device).float()])
            loss_value, norm_value = values.tolist()  # the step's one host sync
            recorder.log(step, loss_value, norm_value, float(lr))
            if step % t.logging_steps == 0 or step == total_steps:
                print(progress_line(step, total_steps, recorder.rows, device), flush=True)
            stopping = stop is not None and stop.requested is not None and step < total_steps
            if checkpoint_dir and (stopping or (t.save_steps and step % t.save_steps == 0 and step < total_steps)):
                save_loop_state(checkpoint_dir, step, accelerator.unwrap_model(model), optimizer, scheduler,
                                recorder, checkpoint_meta or {})
            if stopping:
                raise Interrupted(stop.requested, step)
            if step >= total_steps:
                break
        if step >= total_steps:
            break
    return accelerator.unwrap_model(model, keep_fp32_wrapper=False), recorder
