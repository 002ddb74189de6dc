"""One training, untracked: :func:`plan`, :func:`build_model`, then :func:`train` (or :func:`fit`).

:func:`plan` decides everything that needs no model: the device, the ``auto`` memory budget, this
configuration's checkpoint folder and the checkpoint to resume from (:class:`ResumePoint`), the batch
layout (computed once; for ``auto`` without a checkpoint it is left to the finder, which needs the
model), the equivalence key, the flattened params and the model's path. :func:`build_model` builds the
configured model; :func:`train` trains it with the backend named by ``train.backend``
(:mod:`onegpu.training.backends.base`); :func:`fit` is the same with the host allocator set (bench's
untracked arms). The MLflow run around them is :mod:`onegpu.training.tracked_run`'s: this module
knows nothing of tracking.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from onegpu import interpreter, paths
from onegpu.config import Config, DeviceFacts, Resolved, check_device, flatten, resolve, with_layout
from onegpu.equivalence import equivalence_key, run_config_hash
from onegpu.errors import ConfigError
from onegpu.measure import memory
from onegpu.models import loader, lora
from onegpu.training import objectives, prepared, validation
from onegpu.training.backends import base
from onegpu.training.lifecycle.interrupt import GracefulStop
from onegpu.training.lifecycle.resume import ResumePoint, latest_checkpoint
from onegpu.training.memory import autobatch, checkpointing, host_allocator
from onegpu.training.objectives import lm_head
from onegpu.training.parallel import distributed


@dataclass(frozen=True)
class TrainPlan:
    """What one training run will do, decided before any model exists.

    ``stats``: data/stats.json (``fingerprint``, ``labels``); ``device``: ``"cuda:0"`` or ``"cpu"``;
    ``budget``: bytes the ``auto`` finder may use (None for a fixed micro-batch); ``checkpoint_dir``: this
    configuration's checkpoints; ``resume``: the checkpoint to continue from (None: start afresh);
    ``resolved``: the batch layout, None only while ``auto`` still has to find the micro-batch;
    ``key``: the equivalence key (:func:`onegpu.equivalence.equivalence_key`); ``params``: ``cfg``
    flattened to dotted keys (:func:`onegpu.config.flatten`, as the run logs them; ``auto`` as given);
    ``model_path``: ``model.name_or_path`` resolved (:func:`onegpu.models.loader.resolve_model_path`;
    None: a model built from config).
    """
    cfg: Config
    stats: dict
    device: str
    budget: int | None
    checkpoint_dir: Path
    resume: ResumePoint | None
    resolved: Resolved | None
    key: str
    params: dict
    model_path: str | None

    @property
    def fingerprint(self) -> str:
        return self.stats["fingerprint"]


def check_flattened(cfg: Config, model_path: str | None) -> None:
    """Raises ConfigError, before any work, when ``data.padding_free`` or ``data.packing`` asks for rows
    of several sequences and the model at ``model_path`` (resolved; None: built from config) cannot keep
    them apart (:func:`onegpu.models.loader.packed_sequences_problem`)."""
    if not objectives.flattened(cfg):
        return
    key = "data.packing" if cfg.data.packing else "data.padding_free"
    problem = loader.packed_sequences_problem(model_path, cfg.model.attn_implementation)
    if problem:
        raise ConfigError(f"params.yaml: {key}: {problem}; set {key}: false")


def check_resumable(cfg: Config, resume: ResumePoint | None) -> None:
    """Raises ConfigError, before any work, when ``resume`` (this training's newest complete checkpoint; None:
    none) is held in another layout than ``cfg`` trains in: whole weights (data parallel, one process) under
    ``train.fsdp``, or shards under data parallel (``train.fsdp`` is outside the checkpoint hash). Another split
    resumes: whole weights load on any number of processes, shards reshard on load
    (:func:`onegpu.training.lifecycle.resume.load_sharded_state`)."""
    if resume is None:
        return
    fsdp = cfg.train.fsdp.enabled
    if fsdp and resume.sharded is None:
        raise ConfigError(f"params.yaml: train.fsdp.enabled: a checkpoint of this training with whole weights exists "
                          f"({resume.path}), and a sharded run resumes only sharded checkpoints; resume it with "
                          "train.fsdp.enabled: false (the same training) or delete it")
    if not fsdp and resume.sharded is not None:
        raise ConfigError(f"params.yaml: train.fsdp.enabled: a sharded checkpoint of this training exists "
                          f"({resume.path}); resume it with train.fsdp.enabled: true (the same training) or delete it")


def plan(cfg: Config, stats: dict | None = None, facts: DeviceFacts | None = None) -> TrainPlan:
    """The :class:`TrainPlan` for ``cfg`` on the prepared data ``stats`` (None: read data/stats.json after
    the device checks, so a bad precision flag is named before missing data); fails before any work.

    ``facts``: the machine (None: :func:`onegpu.measure.memory.device_facts`). The device is ``cuda:LOCAL_RANK``
    with CUDA (each process of a multi-process launch on its own GPU), else ``cpu``.
    Raises:
        ConfigError: a combination this machine cannot run (:func:`onegpu.config.check_device`); ``auto``
            on a CPU without ``train.memory_budget_gib``; a checkpoint this layout cannot resume
            (:func:`check_resumable`).
        DataError: ``stats`` is None and prepare has not run.
        ModelError: ``model.name_or_path`` names no model.
    """
    facts = memory.device_facts() if facts is None else facts
    check_device(cfg, facts)
    model_path = loader.resolve_model_path(cfg.model.name_or_path)
    check_flattened(cfg, model_path)  # the model's side: can it keep a flattened row's sequences apart?
    device = f"cuda:{distributed.local_rank()}" if facts.cuda else "cpu"
    stats = prepared.load_stats() if stats is None else stats
    validation.check_plan(cfg, stats)  # an empty validation split, an eval_steps beyond the run
    auto = cfg.train.per_device_train_batch_size == "auto"
    budget = autobatch.budget_bytes(cfg.train.memory_budget_gib, device) if auto else None
    ckpt_dir = paths.checkpoint_dir(run_config_hash(cfg, stats["fingerprint"]))
    resume = latest_checkpoint(ckpt_dir)
    check_resumable(cfg, resume)
    # auto: the split the checkpoint was written with (on another number of processes the finder runs again)
    same_world = resume is not None and resume.num_processes in (None, cfg.train.num_processes)
    micro = resume.micro_batch if auto and same_world else None
    resolved = resolve(cfg, micro_batch=micro) if not auto or micro else None
    # The key reads the effective batch only, which `auto` keeps fixed: known before the finder runs.
    layout = resolved or Resolved(cfg.train.effective_batch_size, 1, 1)
    return TrainPlan(cfg, stats, device, budget, ckpt_dir, resume, resolved,
                     equivalence_key(cfg, layout, stats["fingerprint"]), flatten(cfg.to_dict()), model_path)


def build_model(cfg: Config, model_path: str | None, stats: dict, tokenizer=None):
    """``(model, tokenizer)`` as configured, seeded with ``train.seed`` (the new head's init draws from it).

    ``model_path``: ``model.name_or_path`` resolved (:attr:`TrainPlan.model_path`; None: built from
    config); ``stats``: needs ``labels`` (a classifier's classes); ``tokenizer``: None loads the model's
    (or prepare's, for a model built from config).

    With ``model.lora`` the model is a ``peft.PeftModel`` (:func:`onegpu.models.lora.apply`). A causal LM
    with ``train.fused_lm_head`` returns hidden states in train mode
    (:func:`onegpu.training.objectives.lm_head.attach`).
    Raises:
        ModelError: ``train.gradient_checkpointing`` on a model that does not support it (or its
            ``gradient_checkpointing_blocks``, :func:`onegpu.training.memory.checkpointing.check`); LoRA target
            modules that match nothing; ``train.fused_lm_head`` on a causal LM whose logits it would not
            reproduce (:func:`onegpu.training.objectives.lm_head.check`).
    """
    from transformers import set_seed  # heavy: estimate and the launcher import this module too
    objective = objectives.of(cfg)
    if tokenizer is None:
        tokenizer = loader.load_tokenizer(str(paths.TOKENIZER) if model_path is None else model_path, cfg.model.task)
    set_seed(cfg.train.seed)
    if objective.causal_lm:  # a causal LM, whatever it is trained for
        model = loader.build_causal_lm(model_path, tokenizer, cfg.model, cfg.data.max_length,
                                       objective.dropout(cfg), cfg.model.attn_implementation)
    else:
        model = loader.build_classifier(model_path, stats["labels"], cfg.model.dropout, cfg.model.attn_implementation)
    checkpointing.check(model, cfg.train)
    if cfg.model.lora_adapters is not None:
        model = lora.apply(model, cfg.model.lora_adapters, cfg.model.task, cfg.train.gradient_checkpointing)
    if objective.causal_lm and cfg.train.fused_lm_head:
        lm_head.check(model, f"model.name_or_path {cfg.model.name_or_path or 'null (built from config)'}")
        lm_head.attach(model)
    objective.prepare_model(model, cfg)
    return model, tokenizer


def fit(plan: TrainPlan, model, tokenizer, dsd, sink: Callable[[dict, int], None], run_id: str = "",
        checkpoints: bool = True):
    """The host allocator set (``train.cpu_allocator``, :mod:`onegpu.training.memory.host_allocator`), then
    :func:`train` (bench's untracked arms; the tracked run sets the allocator itself, to tag the run with it)."""
    host_allocator.apply(plan.cfg.train.cpu_allocator, plan.device)  # before the first step allocates
    return train(plan, model, tokenizer, dsd, sink, run_id, checkpoints)


def train(plan: TrainPlan, model, tokenizer, dsd, sink: Callable[[dict, int], None], run_id: str = "",
          checkpoints: bool = True, stop: GracefulStop | None = None):
    """Train with the configured backend; returns ``(model, StepRecorder)``.

    ``plan.resolved`` must be set (the ``auto`` finder has run). ``checkpoints``: as the stage does it,
    resumable (checkpoints every ``train.save_steps`` and on Ctrl-C/SIGTERM/SIGHUP, a clean stop, into
    ``plan.checkpoint_dir``; ``plan.resume`` continued); False trains without either (benchmarks).
    ``stop``: the run's :class:`GracefulStop` (the tracked run's; None: one for this call alone); its loop
    phase covers the backend's loop.
    Raises:
        onegpu.training.lifecycle.interrupt.Interrupted: a stop was requested (after the checkpoint is saved).
    """
    backend = base.get(plan.cfg.train.backend)
    dsd = objectives.of(plan.cfg).prepared_data(dsd, model, tokenizer, plan.cfg)  # before a resume loads weights
    interpreter.settle()  # the steps collect garbage as in any PyTorch process (after the imports' tuning)
    cfg = with_layout(plan.cfg, plan.resolved)
    if not checkpoints:
        with stop.loop() if stop is not None else contextlib.nullcontext():
            return validation.finish(*backend.train(base.TrainRequest(model, tokenizer, dsd, cfg, sink)))
    layout = plan.resolved
    meta = {"run_id": run_id, "micro_batch": layout.per_device_train_batch_size,
            "gradient_accumulation_steps": layout.gradient_accumulation_steps, "num_processes": layout.world_size}
    with contextlib.ExitStack() as stack:
        stop = stop or stack.enter_context(GracefulStop())
        stack.enter_context(stop.loop())
        return validation.finish(*backend.train(base.TrainRequest(
            model, tokenizer, dsd, cfg, sink, checkpoint_dir=plan.checkpoint_dir, stop=stop, resume=plan.resume,
            checkpoint_meta=meta)))
