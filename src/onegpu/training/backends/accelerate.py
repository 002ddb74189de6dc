"""The ``accelerate`` backend: a plain training loop on 🤗 Accelerate (in the style of nanoGPT's train.py).

It trains the same way as the ``trainer`` backend (:mod:`onegpu.training.backends.hf_trainer`), so that on the same
params both give the same per-step losses: the same data order (a ``RandomSampler`` reseeded with
``train.seed + epoch`` each epoch), collator, optimizer with weight-decay groups, scheduler and warmup,
gradient clipping, number of optimizer steps, and the exact loss over each effective batch
(:mod:`onegpu.training.objectives.loss`). Where a line copies the behaviour of HF ``Trainer``, the comment names the
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
from dataclasses import dataclass
from functools import partial

from onegpu.config import TORCHAO_OPTIMIZERS, Config
from onegpu.measure import memory
from onegpu.training import around_steps, objectives, validation
from onegpu.training.backends.base import TrainRequest
from onegpu.training.lifecycle import oom
from onegpu.training.lifecycle.resume import (
    load_loop_state,
    load_rng,
    load_sharded_state,
    save_loop_state,
    save_sharded_state,
)
from onegpu.training.objectives.batches import own_micro_batches, rows_as_they_are
from onegpu.training.parallel import distributed, machines, sharding
from onegpu.training.record.recorder import StepRecorder

# Parameter names that get no weight decay: Trainer.get_decay_parameter_names (transformers/trainer.py).
NO_DECAY_PATTERNS = [r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"]


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
    ``_get_rmsprop``, ``_get_adafactor``, ``_get_bitsandbytes_optimizer``, ``_get_torchao_optimizer``) with
    ``TrainingArguments``' defaults: AdamW betas (0.9, 0.999), eps 1e-8 (torchao's AdamW8bit/AdamW4bit also
    ``block_size=256``, Trainer's default for both, where AdamW4bit's own is 128, and no bf16 stochastic
    rounding); the others take torch's defaults and only ``lr``.
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
    if t.optim == "adamw_bnb_8bit":  # _get_bitsandbytes_optimizer: bnb AdamW, optim_bits=8, not paged
        import bitsandbytes as bnb
        return bnb.optim.AdamW(groups, lr=t.learning_rate, betas=(0.9, 0.999), eps=1e-8, optim_bits=8,
                               is_paged=False)
    if t.optim in TORCHAO_OPTIMIZERS:  # _get_torchao_optimizer: block_size 256 for both
        from torchao.optim import AdamW4bit, AdamW8bit
        cls = AdamW8bit if t.optim == "adamw_torch_8bit" else AdamW4bit
        return cls(groups, lr=t.learning_rate, betas=(0.9, 0.999), eps=1e-8, block_size=256,
                   bf16_stochastic_round=False)
    raise ValueError(f"train.optim={t.optim!r} is not supported by the accelerate backend")


def _forward_backward(accelerator, model, micro_batches: list[dict], num_items, loss_of, pieces: int,
                      oom_injector, step: int, offload=None, group: int = 1, fsdp: bool = False,
                      pads: frozenset = frozenset(), pad_of=None):
    """Forward and backward over one optimizer step's micro-batches, each cut into ``pieces`` pieces.

    Returns this rank's share of the step's loss (a 0-d tensor on the device, not synced): the sum of
    the pieces' losses, each already divided by the step's item count over all ranks ``num_items``
    (``loss_of``: the objective's :meth:`~onegpu.training.objectives.base.Objective.step_loss`).
    Gradients are all-reduced (under DDP) only after the last piece (``accelerator.no_sync`` before; under
    ``fsdp``, FSDP2's ``set_requires_gradient_sync(False)``, :func:`onegpu.training.parallel.sharding.gradient_sync`:
    reduce-scattered once); each piece's backward is scaled by the number of processes, since DDP and FSDP2
    average the ranks' gradients where the step's loss sums them. Pieces hold whole groups of ``group`` rows
    (:func:`onegpu.training.lifecycle.oom.cut`).
    ``labels`` stay in the inputs. ``offload``: the context each piece's forward and backward run in
    (:func:`onegpu.training.around_steps.offload_context`; None: none). The micro-batches at ``pads`` are only
    accelerate's repeats (several processes, an epoch's last step): their loss is ``pad_of``'s, 0.
    Raises:
        torch.OutOfMemoryError: a piece did not fit (or ``oom_injector`` said so).
    """
    parts = [(p, i in pads) for i, inputs in enumerate(micro_batches) for p in oom.cut(inputs, pieces, group)]
    step_loss = None  # in the loss's dtype, added in Trainer's order: both backends log the same float
    scale = accelerator.num_processes
    offload = offload or contextlib.nullcontext()
    for i, (piece, pad) in enumerate(parts):  # never empty
        last = i == len(parts) - 1
        accelerator.sync_gradients = last  # as Trainer sets it; the optimizer steps only when True
        oom.injected(oom_injector, step, piece)
        unsynced = sharding.gradient_sync(model, last) if fsdp else (
            contextlib.nullcontext() if last else accelerator.no_sync(model))
        with unsynced, offload:
            loss = pad_of(model, piece) if pad else loss_of(model, piece, num_items)  # its share of the mean
            accelerator.backward(loss * scale if scale > 1 else loss)  # Accelerate's accumulation count is 1
        step_loss = loss.detach() if step_loss is None else step_loss + loss.detach()
    return step_loss


@dataclass
class _Loop:
    """What the loop works with, built by :func:`_build` in Trainer's order (the RNG draws depend on it)."""
    accelerator: object
    model: object
    optimizer: object
    scheduler: object
    loader: object
    train_set: object
    collator: object
    total_steps: int
    steps_per_epoch: int
    epochs: int
    plateau: bool
    offload: object  # the forward/backward context of train.activation_offloading
    skeleton: object = None  # train.fsdp: the plain model (parameters on meta) that the trained weights go into


def _build(req: TrainRequest) -> _Loop:
    """Accelerator, data loader, model set-up, optimizer and scheduler, as Trainer builds them."""
    from datetime import timedelta

    import torch
    from accelerate import Accelerator, DataLoaderConfiguration
    from accelerate.utils import InitProcessGroupKwargs
    from torch.utils.data import DataLoader, RandomSampler
    from transformers import get_scheduler
    from transformers.trainer_utils import align_special_tokens, seed_worker
    model, cfg = req.model, req.cfg
    t = cfg.train
    # Data order as Trainer's: a RandomSampler that Accelerate replaces by its SeedableRandomSampler,
    # reseeded with data_seed + epoch at each epoch (transformers' AcceleratorConfig has
    # use_seedable_sampler=True; hf_trainer sets data_seed = train.seed; accelerate/data_loader.py).
    cuda = memory.cuda_available()
    if cuda:  # as TrainingArguments sets train.tf32 (transformers' enable_tf32); a no-op on CPU
        from transformers.utils.import_utils import enable_tf32, is_torch_tf32_available
        if t.tf32 or is_torch_tf32_available():
            enable_tf32(t.tf32)
    # torch.compile as Trainer asks Accelerate for it (Trainer.create_accelerator_and_postprocess):
    # a dynamo plugin, backend inductor (TrainingArguments' default), compiled in prepare().
    dynamo = None
    if t.torch_compile:
        from accelerate.utils import TorchDynamoPlugin
        dynamo = TorchDynamoPlugin(backend="inductor", mode=t.torch_compile_mode)
    # Several processes (distributed.py): NCCL on GPUs, gloo on a CPU (cpu=True); collectives time out.
    accelerator = Accelerator(
        cpu=not cuda, mixed_precision=t.mixed_precision, dynamo_plugin=dynamo,
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=distributed.TIMEOUT_S))],
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=t.seed))
    parts = objectives.training_parts(req.dsd, cfg, req.tokenizer)
    rows, collator = parts.rows, parts.collator
    # Several processes: rows uncollated, the loop leaves out accelerate's repeats and collates (_epoch_steps).
    loader = DataLoader(
        rows, batch_size=t.per_device_train_batch_size,
        sampler=objectives.of(cfg).sampler(rows, cfg) or RandomSampler(rows),
        drop_last=False, collate_fn=collator if t.num_processes == 1 else rows_as_they_are,
        num_workers=t.dataloader_num_workers,
        pin_memory=cuda if t.dataloader_pin_memory is None else t.dataloader_pin_memory,
        worker_init_fn=partial(seed_worker, num_workers=t.dataloader_num_workers,
                               rank=accelerator.process_index))
    # Model: as Trainer does (__init__ sets config.use_cache = TrainingArguments.use_cache, False;
    # Trainer.train enables checkpointing and aligns special tokens before its loop).
    if getattr(model, "config", None) is not None:
        model.config.use_cache = False
    around_steps.enable_checkpointing(model, t)
    align_special_tokens(model, req.tokenizer)
    model, optimizer, loader, skeleton = _prepare(accelerator, model, loader, cfg, "cuda" if cuda else "cpu")
    # The scheduler is not prepared (neither is Trainer's): Accelerate would step it once per process.
    total_steps, steps_per_epoch, epochs = around_steps.schedule(len(loader), cfg)
    warmup = math.ceil(total_steps * t.warmup_ratio)  # TrainingArguments.get_warmup_steps for a ratio < 1
    scheduler = get_scheduler(t.lr_scheduler_type, optimizer=optimizer, num_warmup_steps=warmup,
                              num_training_steps=total_steps)
    plateau = isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)  # stepped by eval only
    return _Loop(accelerator, model, optimizer, scheduler, loader, rows, collator, total_steps,
                 steps_per_epoch, epochs, plateau, around_steps.offload_context(model, t.activation_offloading),
                 skeleton)


def _prepare(accelerator, model, loader, cfg: Config, device_type: str):
    """``(model, optimizer, loader, skeleton)``: the optimizer built on the model's parameters, both and the
    loader prepared by Accelerate (DDP under several processes); under ``train.fsdp`` the model sharded first
    (:func:`_shard`) and left out of ``prepare`` (accelerate would wrap it in DDP), ``skeleton`` the plain model
    ``models/`` is gathered into (None without ``train.fsdp``)."""
    if not cfg.train.fsdp.enabled:
        optimizer = make_optimizer(model, cfg)
        return (*accelerator.prepare(model, optimizer, loader), None)
    skeleton = _shard(accelerator, model, cfg.train, device_type)
    objectives.of(cfg).shard(model, lambda m: sharding.shard(m, device_type, cfg.train.fsdp.reshard_after_forward))
    optimizer, loader = accelerator.prepare(make_optimizer(model, cfg), loader)
    return model, optimizer, loader, skeleton


def _shard(accelerator, model, t, device_type: str):
    """``train.fsdp``: ``model`` sharded in place with FSDP2 (:func:`onegpu.training.parallel.sharding.shard`) and
    given accelerate's mixed-precision forward (``prepare_model`` in evaluation mode: autocast, no DDP wrapper).
    Returns the plain skeleton (:func:`onegpu.training.parallel.sharding.meta_copy`) that ``models/`` is gathered
    into."""
    skeleton = sharding.meta_copy(model)
    shards = sharding.shard(model, device_type, t.fsdp.reshard_after_forward)
    accelerator.prepare_model(model, evaluation_mode=True)
    distributed.print_main(f"accelerate: FSDP2 (fully_shard) over {accelerator.num_processes} processes: {shards} "
                           f"blocks and the root, reshard_after_forward {t.fsdp.reshard_after_forward}")
    return skeleton


def _plain(lp: _Loop):
    """The model without Accelerate's and torch.compile's wrappers (same parameters)."""
    return lp.accelerator.unwrap_model(lp.model, keep_torch_compile=False)


def _optimizer_step(lp: _Loop, cfg: Config, recorder: StepRecorder):
    """Clip, step the optimizer and the scheduler, zero the gradients. Returns (grad norm, learning rate)."""
    t = cfg.train
    # Norm before clipping; with max_grad_norm 0 an infinite bound only measures it
    # (Trainer._clip_grad_norm / _get_grad_norm).
    # Under FSDP2 the norm is a DTensor over the shards: made whole (never the local shard's).
    grad_norm = sharding.global_norm(lp.accelerator.clip_grad_norm_(lp.model.parameters(),
                                                                    t.max_grad_norm or float("inf")))
    lp.optimizer.step()
    recorder.record_states(lp.model, lp.optimizer)  # once: grads and optimizer states exist now
    lr = lp.optimizer.param_groups[0]["lr"] if lp.plateau else lp.scheduler.get_last_lr()[0]
    if not lp.accelerator.optimizer_step_was_skipped and not lp.plateau:  # fp16 skips steps with inf grads
        lp.scheduler.step()
    lp.optimizer.zero_grad(set_to_none=True)
    return grad_norm, lr


def _epoch_steps(lp: _Loop, epoch: int, skip: int, accum: int):
    """The optimizer steps of ``epoch`` after the first ``skip``: yields each step's micro-batches (collated, on
    the device) and the indices of those that are only repeats (several processes: :func:`_own_batches`).

    Prefetches a step's micro-batches (to count its items before the first forward, as
    Trainer.get_batch_samples); the epoch's last step takes what is left. A resumed epoch draws the
    same order (the sampler is seeded per epoch) and skips what was done."""
    lp.loader.set_epoch(epoch)
    batches = iter(lp.accelerator.skip_first_batches(lp.loader, skip * accum) if skip else lp.loader)
    for update in range(skip, lp.steps_per_epoch):
        n = accum if update < lp.steps_per_epoch - 1 else (len(lp.loader) % accum or accum)
        raw = list(itertools.islice(batches, n))
        yield (raw, frozenset()) if lp.accelerator.num_processes == 1 else _own_batches(lp, raw, update * accum)


def _own_batches(lp: _Loop, raw: list[list[dict]], first: int) -> tuple[list[dict], frozenset]:
    """A step's uncollated micro-batches (this process's ``first``-th of the epoch onwards) collated without
    accelerate's repeated rows (:func:`onegpu.training.objectives.batches.own_rows`), on the device; and the indices of
    those with no row of their own (their loss weighs 0: :meth:`~onegpu.training.objectives.base.Objective.
    pad_loss`)."""
    acc, micro = lp.accelerator, lp.loader.total_batch_size // lp.accelerator.num_processes
    out, counted = own_micro_batches(raw, first, acc.process_index, acc.num_processes, micro, len(lp.train_set),
                                     lp.collator, acc.device)
    return out, frozenset(j for j, own in enumerate(counted) if not own)


def train(req: TrainRequest) -> tuple[object, StepRecorder]:
    """Fine-tune ``req.model`` on ``req.dsd['train']`` in a plain Accelerate loop; the contract is
    :class:`onegpu.training.backends.base.Backend`.

    Checkpoints are :func:`onegpu.training.lifecycle.resume.save_loop_state`'s (under ``train.fsdp``
    :func:`~onegpu.training.lifecycle.resume.save_sharded_state`'s: every process its shards). Out-of-memory recovery
    (``train.oom_retry``): :mod:`onegpu.training.lifecycle.oom`, as the ``trainer`` backend. The returned model is
    unwrapped from Accelerate; the recorder's rows are one per optimizer step (loss = the step's exact
    mean loss, grad_norm = total L2 norm before clipping, learning_rate = the rate that step used).
    """
    from transformers import set_seed
    cfg, t, resume = req.cfg, req.cfg.train, req.resume
    set_seed(t.seed)  # Trainer.__init__ seeds again after the model is built (dropout draws from here)
    lp = _build(req)
    recorder = around_steps.new_recorder(cfg, req.sink, lp.accelerator.device, lp.model)
    recorder.validation = validation.for_run(_plain(lp), req.tokenizer, req.dsd, cfg, lp.accelerator.device,
                                             lp.total_steps, lp.steps_per_epoch, req.checkpoint_dir)
    around_steps.announce(around_steps.Start(
        "accelerate", lp.total_steps, t.per_device_train_batch_size, t.gradient_accumulation_steps, t.num_processes,
        len(lp.train_set), lp.epochs, lp.accelerator.device, lp.accelerator.mixed_precision, t.logging_steps,
        objectives.of(cfg).start_words(cfg)), t.optim)
    start = 0
    if resume is not None:  # weights, optimizer, scheduler; the data position and RNG in _run
        if lp.skeleton is not None:  # train.fsdp: every process loads its shards (torch.distributed.checkpoint)
            load_sharded_state(resume.path, lp.model, lp.optimizer, lp.scheduler)
        else:
            load_loop_state(resume.path, _plain(lp), lp.optimizer, lp.scheduler)
        start = resume.step
        recorder.restore(resume)
        distributed.print_main(f"accelerate: resuming after optimizer step {start}")
    lp.model.train()
    lp.optimizer.zero_grad(set_to_none=True)
    probe = around_steps.activation_probe(lp.train_set, lp.collator, t, cfg.model.task)
    around_steps.begin(recorder, _plain(lp), probe, lp.accelerator.device)
    _run(lp, req, recorder, start)
    if lp.skeleton is not None:  # train.fsdp: the full weights gathered into a plain model (rank 0)
        return sharding.gather(lp.model, lp.skeleton), recorder
    return lp.accelerator.unwrap_model(lp.model, keep_fp32_wrapper=False, keep_torch_compile=False), recorder


def _run(lp: _Loop, req: TrainRequest, recorder: StepRecorder, start: int) -> None:
    """The optimizer steps from ``start`` to the end: one host sync per step (loss, grad norm, counts)."""
    import torch
    cfg, resume = req.cfg, req.resume
    t, device, objective = cfg.train, lp.accelerator.device, objectives.of(cfg)
    accum = t.gradient_accumulation_steps
    step, pieces = start, 1  # pieces per micro-batch (more after out-of-memory recoveries)
    first_epoch, first_update = divmod(start, lp.steps_per_epoch)
    for epoch in range(first_epoch, lp.epochs):
        for micro_batches, pads in _epoch_steps(lp, epoch, first_update if epoch == first_epoch else 0, accum):
            if resume is not None and step == start:
                # Only now: a fresh DataLoader iterator draws its base seed from the global RNG at its
                # first batch, which the uninterrupted run did before step 1. Dropout then matches.
                load_rng(resume.path)
            micro_batches = objective.step_batches(lp.model, micro_batches, step + 1)  # (GRPO: generations)
            # The step's items over all ranks: each rank's loss is its share of the whole step's mean.
            own = [b for i, b in enumerate(micro_batches) if i not in pads]  # (pads: repeats only)
            num_items = around_steps.step_items(objective, own, device)
            while True:  # more than once only after an out-of-memory error (train.oom_retry)
                try:
                    step_loss = _forward_backward(lp.accelerator, lp.model, micro_batches, num_items,
                                                  objective.step_loss, pieces, req.oom_injector, step + 1,
                                                  lp.offload, objective.sequences_per_item, t.fsdp.enabled,
                                                  pads, objective.pad_loss)
                    break
                except torch.OutOfMemoryError as e:
                    pieces = around_steps.recover(e, lp.model, micro_batches, pieces, accum, step + 1, t.oom_retry,
                                                  recorder.events, objective)  # the whole step is redone
            for inputs in own:  # counted once, however many pieces
                recorder.counter.add(inputs)
            grad_norm, lr = _optimizer_step(lp, cfg, recorder)
            step += 1
            recorder.end_step(step)
            # The step's loss: the ranks' shares summed (gradients, hence grad_norm, are already whole).
            # float64 (a float32 loss is exact in it; a float64 model's is not rounded to float32).
            step_loss = distributed.sum_over_ranks(step_loss.double())
            values = torch.stack([step_loss, torch.as_tensor(grad_norm, device=device).double()])
            loss_value, norm_value = values.tolist()  # the step's one host sync
            recorder.log(step, loss_value, norm_value, float(lr))
            around_steps.empty_cache(step, t.torch_empty_cache_steps)
            _after_step(lp, req, recorder, step)
            if step >= lp.total_steps or recorder.stopped_early:
                return


def _after_step(lp: _Loop, req: TrainRequest, recorder: StepRecorder, step: int) -> None:
    """Progress line, checkpoint (every ``train.save_steps`` and on a requested stop) and the stop itself.

    Raises:
        Interrupted: a stop was requested (after the checkpoint is saved).
    """
    t, stop, checkpoint_dir = req.cfg.train, req.stop, req.checkpoint_dir
    around_steps.progress(recorder, step, lp.total_steps, t.logging_steps)
    requested = around_steps.stop_requested(stop, lp.accelerator.num_processes, lp.accelerator.device)
    stopping = requested and step < lp.total_steps and not recorder.stopped_early  # early stopping: complete
    if checkpoint_dir and (stopping or (t.save_steps and step % t.save_steps == 0 and step < lp.total_steps)):
        if lp.skeleton is not None:  # train.fsdp: every process writes its shards
            save_sharded_state(checkpoint_dir, step, lp.model, lp.optimizer, lp.scheduler, recorder,
                               req.checkpoint_meta or {})
        elif machines.writes_checkpoint():  # one writer per folder; the ranks' weights and optimizer states are equal
            save_loop_state(checkpoint_dir, step, _plain(lp), lp.optimizer, lp.scheduler,
                            recorder, req.checkpoint_meta or {})
        lp.accelerator.wait_for_everyone()
    if stopping:
        raise around_steps.interruption(stop, step)
