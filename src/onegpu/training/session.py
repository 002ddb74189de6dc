"""One training run, as the train stage and ``bench/`` run it: :func:`plan` then :func:`run`.

:func:`plan` decides everything that needs no model: the device, the ``auto`` memory budget, this
configuration's checkpoint folder and the checkpoint to resume from (:class:`ResumePoint`), the batch
layout (computed once; for ``auto`` without a checkpoint it is left to the finder, which needs the
model) and the equivalence key. :func:`run` opens the MLflow run, builds the model, trains with the
backend named by ``train.backend`` (:mod:`onegpu.training.backends.base`), logs what the recorder
measured, and hands the result to the caller's ``save`` inside the run's guard (an error there fails
the run). :func:`train` is the training alone, :func:`fit` the same with the host allocator set
(bench's untracked arms).

The run ends SCHEDULED, not FINISHED: the configuration's run is finished once evaluate has logged into it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import shutil
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from onegpu import paths
from onegpu.config import Config, DeviceFacts, Resolved, TrainConfig, check_device, flatten, resolve, with_layout
from onegpu.equivalence import equivalence_key, resolved_params, run_config_hash
from onegpu.errors import ConfigError, DataError, DiskFullError, ModelError
from onegpu.formatting import gib, size
from onegpu.measure import memory, outside_load
from onegpu.models import loader
from onegpu.training.interrupt import GracefulStop, Interrupted
from onegpu.training.resume import ResumePoint, tidy_other_checkpoints

_BUDGET_CPU = ("; on a CPU the budget covers the training state: params, grads, optimizer states and "
               "activations, not the whole process")


CONFIG_TAG = "config"  # the run's settings in a few characters (config_name), also on DVC-named runs


def config_name(cfg: Config) -> str:
    """The training settings as a run name: the split (``bs<micro>x<accumulation>``, ``bsauto-eff<N>``
    for ``auto``, ``x<N>proc`` with several processes), the precision, then the knobs that are on or not
    at their default: ``ckpt``, ``lora-r<r>``, ``padfree``, ``packing``, ``compile``, another backend or
    optimizer. E.g. ``bs4x4-fp32-ckpt``, ``bs16x1-bf16-lora-r8-accelerate``. The train stage names a run
    so when DVC gives no experiment name (``dvc repro``)."""
    t = cfg.train
    micro = t.per_device_train_batch_size
    head = f"bsauto-eff{t.effective_batch_size}" if micro == "auto" else f"bs{micro}x{t.gradient_accumulation_steps}"
    parts = [head + (f"x{t.num_processes}proc" if t.num_processes > 1 else ""),
             "bf16" if t.bf16 else "fp16" if t.fp16 else "tf32" if t.tf32 else "fp32"]
    lora = cfg.model.lora_adapters
    knobs = {"ckpt": t.gradient_checkpointing, f"lora-r{lora.r if lora else 0}": lora is not None,
             "padfree": cfg.data.padding_free, "packing": cfg.data.packing, "compile": t.torch_compile,
             t.backend: t.backend != TrainConfig.backend, t.optim: t.optim != TrainConfig.optim}
    return "-".join(parts + [name for name, on in knobs.items() if on])


@dataclass(frozen=True)
class TrainPlan:
    """What one training run will do, decided before any model exists.

    ``stats``: data/stats.json (``fingerprint``, ``labels``); ``device``: ``"cuda:0"`` or ``"cpu"``;
    ``budget``: bytes the ``auto`` finder may use (None for a fixed micro-batch); ``checkpoint_dir``: this
    configuration's checkpoints; ``resume``: the checkpoint to continue from (None: start afresh);
    ``resolved``: the batch layout, None only while ``auto`` still has to find the micro-batch;
    ``key``: the equivalence key (:func:`onegpu.equivalence.equivalence_key`).
    """
    cfg: Config
    stats: dict
    device: str
    budget: int | None
    checkpoint_dir: Path
    resume: ResumePoint | None
    resolved: Resolved | None
    key: str

    @property
    def fingerprint(self) -> str:
        return self.stats["fingerprint"]


@dataclass
class TrainResult:
    """A finished training: the model and tokenizer to save, the step recorder (``steps.rows``), the
    summary metrics logged to the run, the plan with its final layout, the MLflow run and experiment ids,
    ``saved_config`` (model config values to put back before saving, e.g. ``use_cache``) and
    ``train_s`` (wall seconds inside the backend's ``train``) and ``outside_load`` (what other processes
    took of the machine meanwhile, :mod:`onegpu.measure.outside_load`; None when unmeasured)."""
    model: object
    tokenizer: object
    steps: object
    summary: dict
    plan: TrainPlan
    run_id: str
    experiment_id: str
    saved_config: dict
    train_s: float
    outside_load: dict | None = None


def _require_prepared() -> None:
    if not paths.PROCESSED.is_dir() or not paths.STATS.is_file():
        raise DataError(f"{paths.PROCESSED} or {paths.STATS} is missing: run the prepare stage first (dvc repro)")


def load_processed():
    """The prepared ``DatasetDict`` from data/processed.

    Raises:
        DataError: prepare has not run.
    """
    from datasets import load_from_disk
    _require_prepared()
    return load_from_disk(str(paths.PROCESSED))


def load_stats() -> dict:
    """data/stats.json (labels, content fingerprint, split sizes).

    Raises:
        DataError: prepare has not run.
    """
    _require_prepared()
    return paths.read_json(paths.STATS)


def check_flattened(cfg: Config) -> None:
    """Raises ConfigError, before any work, when ``data.padding_free`` or ``data.packing`` asks for rows
    of several sequences and the model cannot keep them apart (:func:`onegpu.models.loader.packed_sequences_problem`)."""
    from onegpu.training.batches import flattened
    if not flattened(cfg):
        return
    key = "data.packing" if cfg.data.packing else "data.padding_free"
    problem = loader.packed_sequences_problem(loader.resolve_model_path(cfg.model.name_or_path),
                                              cfg.model.attn_implementation)
    if problem:
        raise ConfigError(f"params.yaml: {key}: {problem}; set {key}: false")


def plan(cfg: Config, stats: dict | None = None, facts: DeviceFacts | None = None) -> TrainPlan:
    """The :class:`TrainPlan` for ``cfg`` on the prepared data ``stats`` (None: read data/stats.json after
    the device checks, so a bad precision flag is named before missing data); fails before any work.

    ``facts``: the machine (None: :func:`onegpu.measure.memory.device_facts`). The device is ``cuda:LOCAL_RANK``
    with CUDA (each process of a multi-process launch on its own GPU), else ``cpu``.
    Raises:
        ConfigError: a combination this machine cannot run (:func:`onegpu.config.check_device`); ``auto``
            on a CPU without ``train.memory_budget_gib``.
        DataError: ``stats`` is None and prepare has not run.
    """
    from onegpu.training import distributed
    from onegpu.training.resume import latest_checkpoint
    facts = memory.device_facts() if facts is None else facts
    check_device(cfg, facts)
    check_flattened(cfg)  # the model's side: can it keep a flattened row's sequences apart?
    device = f"cuda:{distributed.local_rank()}" if facts.cuda else "cpu"
    stats = load_stats() if stats is None else stats
    auto = cfg.train.per_device_train_batch_size == "auto"
    budget = None
    if auto:
        from onegpu.training import autobatch
        budget = autobatch.budget_bytes(cfg.train.memory_budget_gib, device)
    ckpt_dir = paths.checkpoint_dir(run_config_hash(cfg, stats["fingerprint"]))
    resume = latest_checkpoint(ckpt_dir)
    micro = resume.micro_batch if auto and resume is not None else None  # the split it was written with
    resolved = resolve(cfg, micro_batch=micro) if not auto or micro else None
    # The key reads the effective batch only, which `auto` keeps fixed: known before the finder runs.
    layout = resolved or Resolved(cfg.train.effective_batch_size, 1, 1)
    return TrainPlan(cfg, stats, device, budget, ckpt_dir, resume, resolved,
                     equivalence_key(cfg, layout, stats["fingerprint"]))


def build_model(cfg: Config, stats: dict, tokenizer=None):
    """``(model, tokenizer)`` as configured, seeded with ``train.seed`` (the new head's init draws from it).

    ``stats``: needs ``labels`` (a classifier's classes); ``tokenizer``: None loads the model's (or
    prepare's, for a model built from config).

    With ``model.lora`` the model is a ``peft.PeftModel`` (:func:`onegpu.models.lora.apply`).
    Raises:
        ModelError: ``train.gradient_checkpointing`` on a model that does not support it (or its
            ``gradient_checkpointing_blocks``); LoRA target
            modules that match nothing.
    """
    from transformers import set_seed
    path = loader.resolve_model_path(cfg.model.name_or_path)
    task = cfg.model.task
    if tokenizer is None:
        tokenizer = loader.load_tokenizer(str(paths.TOKENIZER) if path is None else path, task)
    set_seed(cfg.train.seed)
    if task == "causal-lm":
        model = loader.build_causal_lm(path, tokenizer, cfg.model, cfg.data.max_length, cfg.model.dropout,
                                       cfg.model.attn_implementation)
    else:
        model = loader.build_classifier(path, stats["labels"], cfg.model.dropout, cfg.model.attn_implementation)
    if cfg.train.gradient_checkpointing and not loader.supports_checkpointing(model):
        raise ModelError(f"train.gradient_checkpointing: {type(model).__name__} does not support "
                         "activation checkpointing; set it to false")
    if cfg.train.gradient_checkpointing:
        from onegpu.training import checkpointing
        checkpointing.check_supported(model, cfg.train)
    if cfg.model.lora_adapters is not None:
        from onegpu.models import lora
        model = lora.apply(model, cfg.model.lora_adapters, task, cfg.train.gradient_checkpointing)
    return model, tokenizer


def fit(plan: TrainPlan, model, tokenizer, dsd, sink: Callable[[dict, int], None], run_id: str = "",
        checkpoints: bool = True):
    """The host allocator set (``train.cpu_allocator``, :mod:`onegpu.training.host_allocator`), then
    :func:`train` (bench's untracked arms; :func:`run` sets the allocator itself, to tag the run with it)."""
    from onegpu.training import host_allocator
    host_allocator.apply(plan.cfg.train.cpu_allocator, plan.device)  # before the first step allocates
    return train(plan, model, tokenizer, dsd, sink, run_id, checkpoints)


def train(plan: TrainPlan, model, tokenizer, dsd, sink: Callable[[dict, int], None], run_id: str = "",
          checkpoints: bool = True, stop: GracefulStop | None = None):
    """Train with the configured backend; returns ``(model, StepRecorder)``.

    ``checkpoints``: as the stage does it, resumable (checkpoints every ``train.save_steps`` and on
    Ctrl-C/SIGTERM/SIGHUP, a clean stop, into ``plan.checkpoint_dir``; ``plan.resume`` continued); False
    trains without either (benchmarks). ``stop``: the run's :class:`GracefulStop` (:func:`run`'s; None:
    one for this call alone); its loop phase covers the backend's loop.
    Raises:
        onegpu.training.interrupt.Interrupted: a stop was requested (after the checkpoint is saved).
    """
    from onegpu import interpreter
    from onegpu.training.backends import base
    backend = base.get(plan.cfg.train.backend)
    interpreter.settle()  # the steps collect garbage as in any PyTorch process (after the imports' tuning)
    cfg = with_layout(plan.cfg, plan.resolved)
    if not checkpoints:
        with stop.loop() if stop is not None else contextlib.nullcontext():
            return backend.train(base.TrainRequest(model, tokenizer, dsd, cfg, sink))
    meta = {"run_id": run_id, "micro_batch": plan.resolved.per_device_train_batch_size}
    with contextlib.ExitStack() as stack:
        stop = stop or stack.enter_context(GracefulStop())
        stack.enter_context(stop.loop())
        return backend.train(base.TrainRequest(model, tokenizer, dsd, cfg, sink, checkpoint_dir=plan.checkpoint_dir,
                                               stop=stop, resume=plan.resume, checkpoint_meta=meta))


def run(plan: TrainPlan, tracker, dsd, save: Callable[[TrainResult], None] | None = None,
        built: tuple | None = None, name: str | None = None, probe: bool = False,
        tokenizer=None) -> TrainResult:
    """The whole training run into ``tracker``'s store (a ``tracking.connect`` handle).

    ``save``: writes the outputs from the result, inside the run's guard; ``built``: a ``(model,
    tokenizer)`` to train instead of :func:`build_model`'s (benchmarks); ``name``: the MLflow run name
    (None: the DVC experiment's, else :func:`config_name`); ``probe``: a probe row of ``onegpu
    tradeoffs`` (``plan.resume`` None): no resumable checkpoints, every checkpoint folder left alone, no
    figure (the batch's report plots the rows); ``tokenizer``: the one prepare used (None: the model's).
    Signals are handled from the start to the end of the run's record (:class:`GracefulStop`).
    Returns:
        The :class:`TrainResult`; the run is left SCHEDULED.
    Raises:
        onegpu.training.interrupt.Interrupted: stopped on a signal, with the run id, the steps logged and
            the checkpoint kept on it.
    """
    run_id = _start_run(plan, tracker, name, tidy=not probe)
    rows: list[tuple[int, dict]] = []  # every step the sink got, for the run's figure
    stop = GracefulStop(checkpoints=not probe, progress=lambda: _progress(plan, rows))
    try:
        with stop:
            result = _run(plan, tracker, dsd, run_id, rows, stop, save, built, probe, tokenizer)
            _tidy_checkpoints(plan, tracker, stop, probe)
    except Interrupted as e:
        from onegpu.training.resume import latest_checkpoint
        kept = latest_checkpoint(plan.checkpoint_dir)
        e.run_id, e.steps_logged = run_id, len({s for s, _ in rows})
        e.checkpoint = kept and paths.relative_to_root(kept.path)
        raise
    return result


def _run(plan: TrainPlan, tracker, dsd, run_id: str, rows: list, stop: GracefulStop, save, built, probe: bool,
         tokenizer) -> TrainResult:
    """:func:`run`'s body inside the run's guard: build, find the layout, train, log, save."""
    # Handed to the writer thread at least every 5 s: a SIGKILL (a scheduler's, after its grace period,
    # while a collective hangs) loses at most the last few seconds of steps, never the run's.
    buffer = tracker.metric_buffer(run_id, flush_seconds=5.0)
    load = outside_load.Watch(plan.device, _own_tree_root())

    def sink(metrics: dict, step: int) -> None:
        rows.append((step, metrics))
        buffer.add(metrics, step)

    with tracker.guard(run_id, finish="SCHEDULED", context=lambda: {"error.step": str(_progress(plan, rows)[0] + 1)}), \
            _flushed(buffer), _closing_record(tracker, run_id, rows, load, config_name(plan.cfg), figure=not probe):
        tracker.log_params(run_id, flatten(plan.cfg.to_dict()))
        model, tokenizer = built or build_model(plan.cfg, plan.stats, tokenizer)
        tracker.set_tags(run_id, loader.describe(model))
        # Training switches the KV cache off (Trainer and checkpointing); the saved model gets it back.
        saved_config = {"use_cache": model.config.use_cache} if hasattr(model.config, "use_cache") else {}
        plan = _with_layout(plan, model, tokenizer, dsd, tracker, run_id)
        from onegpu.training.recorder import step_metrics
        for row in (plan.resume.rows if plan.resume else []):  # the stopped run's steps, so this one is whole
            sink(step_metrics(row), row["step"])
        from onegpu.training import host_allocator
        tracker.set_tags(run_id, {"cpu_allocator": host_allocator.apply(plan.cfg.train.cpu_allocator, plan.device)})
        with tracker.system_metrics(run_id):
            load.start()
            t0 = time.perf_counter()
            model, steps = train(plan, model, tokenizer, dsd, sink, run_id, checkpoints=not probe, stop=stop)
            train_s = time.perf_counter() - t0
            load.stop()
        summary = _log_results(plan, tracker, run_id, buffer, model, steps)
        result = TrainResult(model, tokenizer, steps, summary, plan, run_id, tracker.experiment_id,
                             saved_config, train_s, load.result)
        if save is not None:
            save(result)
    return result


def _progress(plan: TrainPlan, rows: list) -> tuple[int, float | None, int | None]:
    """``(optimizer steps done, median seconds per step, newest checkpoint's step)`` from the sink's
    ``rows``: the checkpoint is the resumed one or the last multiple of ``train.save_steps`` (None: none yet)."""
    steps = sorted({s for s, _ in rows})
    times = sorted(m["step_time_s"] for _, m in rows if m.get("step_time_s") is not None)
    done = steps[-1] if steps else (plan.resume.step if plan.resume else 0)
    every = plan.cfg.train.save_steps
    saved = max((done // every) * every if every else 0, plan.resume.step if plan.resume else 0)
    return done, times[len(times) // 2] if times else None, saved or None


def _tidy_checkpoints(plan: TrainPlan, tracker, stop: GracefulStop, probe: bool) -> None:
    """After a finished training (rank 0 of a launch): nothing is left to resume, so this configuration's
    checkpoints go, and the stopped runs' of the same equivalence key. Kept when a signal came while the
    run's record was written: the command that started the stage may be gone (a terminal's SIGHUP and a
    SIGTERM to the group end DVC at once, before it records the stage), and the next one resumes from them."""
    from onegpu.training import distributed
    if probe or not distributed.is_main():  # one process tidies the checkpoints (the others write no MLflow either)
        return
    if stop.noted:
        from onegpu.training.resume import latest_checkpoint
        names = ", ".join(sorted({signal.Signals(n).name for n in stop.noted}))
        kept = latest_checkpoint(plan.checkpoint_dir)
        print(f"train: {names} came after the training finished: its outputs and MLflow run are complete; if "
              "the command that started it ended too, DVC has not recorded the stage and a rerun trains again"
              + (f", from the checkpoint of step {kept.step} (kept)" if kept else
                 " from the start (no checkpoint: train.save_steps writes them)"), flush=True)
        return
    shutil.rmtree(plan.checkpoint_dir, ignore_errors=True)  # finished: nothing left to resume
    tidy_other_checkpoints(plan.checkpoint_dir, plan.key, flatten(plan.cfg.to_dict()), plan.fingerprint,
                           tracker.find_run, finished=True)


def _start_run(plan: TrainPlan, tracker, name: str | None = None, tidy: bool = True) -> str:
    """Say which other checkpoints this run does not use (``tidy``), start the MLflow run ``name`` (None:
    the DVC experiment's, else the settings') with the stage's tags and link it to the run it resumes.
    Returns the run id."""
    from onegpu.training import distributed
    if not distributed.is_main():  # only rank 0 of a multi-process launch writes to MLflow
        return tracker.start_run(None, {})
    from onegpu import tracking
    tags = {**tracking.run_context_tags(), "stage": "train", "equivalence_key": plan.key,
            "device": memory.device_name(plan.device), "data.fingerprint": plan.fingerprint}
    if tidy:
        tidy_other_checkpoints(plan.checkpoint_dir, plan.key, flatten(plan.cfg.to_dict()), plan.fingerprint,
                               tracker.find_run, announce=True)
    resume = plan.resume
    if resume:
        tags["onegpu.resumed_from"] = resume.run_id or ""
        tags["onegpu.resumed_at_step"] = str(resume.step)
    tags[CONFIG_TAG] = config_name(plan.cfg)
    run_id = tracker.start_run(name or tracking.run_name() or tags[CONFIG_TAG], tags)
    distributed.announce_run(run_id, plan.cfg.tracking.experiment_name)
    if resume:
        print(f"train: resuming from {resume.path} (optimizer step {resume.step} of MLflow run "
              f"{resume.run_id}, which was stopped); this run is {run_id}")
        try:
            tracker.set_tags(resume.run_id, {"onegpu.resumed_by": run_id})
        except Exception:
            pass  # the earlier run may be in another store; the link on this run is what matters
    return run_id


def _with_layout(plan: TrainPlan, model, tokenizer, dsd, tracker, run_id: str) -> TrainPlan:
    """``plan`` with its batch layout (the ``auto`` finder runs when it has none yet), logged as
    ``resolved.*`` params."""
    if plan.resolved is None:
        micro = _find_micro_batch(model, tokenizer, dsd, plan, tracker, run_id)
        plan = dataclasses.replace(plan, resolved=resolve(plan.cfg, micro_batch=micro))
        tracker.set_tags(run_id, {CONFIG_TAG: config_name(with_layout(plan.cfg, plan.resolved)) + "-auto"})
    tracker.log_params(run_id, resolved_params(plan.resolved))
    return plan


def _find_micro_batch(model, tokenizer, dsd, plan: TrainPlan, tracker, run_id: str) -> int:
    """Run the ``auto`` finder (:mod:`onegpu.training.autobatch`); print and log its probes."""
    from onegpu.training import autobatch
    from onegpu.training.batches import train_collator, training_rows
    from onegpu.training.loss import loss_for
    cfg, device, budget = plan.cfg, plan.device, plan.budget
    task = cfg.model.task
    model.to(device)
    loader.no_kv_cache(model)  # as training runs it
    if cfg.train.gradient_checkpointing:
        from onegpu.training import checkpointing
        checkpointing.enable(model, cfg.train)
    world = cfg.train.num_processes
    micro, probes = autobatch.find_micro_batch(
        model, training_rows(dsd, task, cfg), train_collator(cfg, tokenizer), loss_for(task),
        cfg.train.effective_batch_size, budget, cfg.train.optim, device, world_size=world,
        mixed_precision=cfg.train.mixed_precision)  # probe under the training's autocast
    from onegpu.training import distributed
    micro = int(min(r[0] for r in distributed.gather_over_ranks([micro], device)))  # one split for all ranks
    table = autobatch.format_probes(probes)
    procs = f" x {world} processes" if world > 1 else ""
    distributed.print_main(
        f"auto micro-batch: {micro} x {cfg.train.effective_batch_size // (micro * world)} accumulation{procs} = "
        f"{cfg.train.effective_batch_size} (budget {gib(budget)}, longest training rows"
        f"{_BUDGET_CPU if not memory.is_cuda(device) else ''})\n{table}")
    tracker.log_dict(run_id, {"budget_bytes": budget, "probes": [p.as_row() for p in probes]},
                     "auto_micro_batch.json")
    tracker.log_text(run_id, table + "\n", "auto_micro_batch.md")
    return micro


def _log_results(plan: TrainPlan, tracker, run_id: str, buffer, model, steps) -> dict:
    """Log what the recorder measured (out-of-memory events, summary, memory, speed, step tags) and
    return the summary metrics."""
    for ev in steps.events:  # out-of-memory recoveries: the split changed, the result did not
        buffer.add({"oom_retry_micro_batch": ev["micro_batch"]}, ev["step"])
    buffer.flush()
    if steps.events:
        import json
        tracker.set_tags(run_id, {"oom_retry.events": json.dumps(steps.events),
                                  "oom_retry.final_split": steps.events[-1]["new"]})
    summary = steps.summary()
    summary.update(steps.memory())
    from onegpu.measure import flops
    speed, speed_params, speed_tags = flops.speed_metrics(
        model, summary, plan.cfg.train.num_processes, plan.cfg.train.mixed_precision, plan.device,
        memory.device_name(plan.device), steps.tokens_sq())
    if "train_mfu.unknown_reason" in speed_tags:
        print(f"train: {speed_tags['train_mfu.unknown_reason']}")
    summary.update(speed)
    tracker.log_params(run_id, speed_params)
    tracker.set_tags(run_id, {**speed_tags, **_step_tags(steps, plan.resolved.effective_batch_size),
                              **table_tags(summary)})
    tracker.log_metrics(run_id, {k: v for k, v in summary.items()
                                 if k not in ("train_steps", "train_samples", "train_tokens")},
                        step=0)  # step 0, like eval_*: MLflow draws a bar, not a lone dot
    return summary


@contextlib.contextmanager
def _flushed(buffer):
    """Write buffered step metrics whatever happens: a failed or stopped run keeps every step it logged."""
    try:
        yield
    finally:
        try:
            buffer.flush()
        except Exception:
            pass


def _step_tags(steps, effective_batch: int) -> dict:
    """Tags from the recorder: ``onegpu.machine``, the training window (``onegpu.train_start_ms`` and
    ``onegpu.train_end_ms``, milliseconds since the epoch, first step's start to last step's end in this
    process) and ``onegpu.partial_steps`` when an optimizer step saw fewer examples than the effective batch."""
    import hashlib
    import json
    import platform
    # Which machine trained (a hash of the host name, not the name): only runs on one machine compete.
    out = {"onegpu.machine": hashlib.sha256(platform.node().encode()).hexdigest()[:12]}
    if steps.window_start is not None and steps.window_end is not None:
        out["onegpu.train_start_ms"] = str(int(steps.window_start * 1000))
        out["onegpu.train_end_ms"] = str(int(steps.window_end * 1000))
    partial = steps.partial_steps(effective_batch)
    if partial:
        out["onegpu.partial_steps"] = json.dumps(partial)
        for p in partial:
            print(f"train: optimizer step {p['step']} saw {p['examples']} of {effective_batch} examples "
                  "(the epoch's last rows); its loss is the mean over those")
    return out




# Tags with the run's costs in people's units, for MLflow's runs table (it prints metrics as raw numbers:
# 1572425728 bytes, nine-digit floats): memory, speed and outside_load.
TABLE_TAGS = ("memory", "speed", "outside_load")


def table_tags(summary: dict, load: dict | None = None) -> dict[str, str]:
    """``memory`` (``train_mem_peak_bytes`` in MiB/GiB), ``speed`` (``train_samples_per_second``,
    e.g. ``2.53 samples/s``) from the summary, and ``outside_load`` (other processes' share of the CPUs,
    e.g. ``71% of 2 CPUs``) from ``load``; each only when measured."""
    out = {}
    if summary.get("train_mem_peak_bytes") is not None:
        out["memory"] = size(summary["train_mem_peak_bytes"])
    if summary.get("train_samples_per_second") is not None:
        out["speed"] = f"{summary['train_samples_per_second']:.2f} samples/s"
    if load is not None and load.get("share") is not None:
        out["outside_load"] = f"{load['share']:.0%} of {load['cpus']} CPUs" + (
            f" + {load['gpu_processes']} GPU process(es)" if load.get("gpu_processes") else "")
    return out


def _own_tree_root() -> int:
    """The pid whose process tree is this training's own: the launcher under a multi-process launch (its
    ranks are its children), else this process."""
    import os

    from onegpu.training import distributed
    return os.getppid() if distributed.launched() else os.getpid()


@contextlib.contextmanager
def _closing_record(tracker, run_id: str, rows: list, load: outside_load.Watch, title: str, figure: bool = True):
    """On the way out, finished or not (rank 0 only): the outside load over the training window as the
    tag ``onegpu.outside_load`` and the metric ``train_outside_cpu_load`` (a line printed when the run
    was under load), and (``figure``) the run's figure (:mod:`onegpu.training.figure`) of the steps measured.
    Nothing here may hide the training's own error."""
    from onegpu.training import distributed
    failed = True
    try:
        yield
        failed = False
    finally:
        if distributed.is_main():
            try:
                _log_closing(tracker, run_id, rows, load.stop(), failed, title, figure)
            except DiskFullError as e:  # the run fails on it, unless it failed already (that error comes first)
                if not failed:
                    raise
                print(f"train: the run's figure was not logged: {e}")
            except Exception as e:  # a figure that cannot be drawn costs the figure only
                print(f"train: the run's figure or outside load was not logged ({type(e).__name__}: {e})")


def _log_closing(tracker, run_id: str, rows: list, load: dict | None, failed: bool, title: str,
                 figure_too: bool = True) -> None:
    import json

    from onegpu.training import figure
    note = []
    if load is not None:
        tracker.set_tags(run_id, {outside_load.TAG: json.dumps(load), **table_tags({}, load)})
        tracker.log_metrics(run_id, {outside_load.METRIC: load["cpu_busy"]}, step=0)
        if outside_load.under_load(load):
            text = outside_load.describe(load)
            print(f"train: measured under outside load: {text} while it trained; its speed is not the "
                  "cost of its settings alone (train again on a quiet machine to time it)")
            note.append(f"under outside load: {text}")
    if not figure_too:
        return
    steps = len({s for s, _ in rows})
    if failed:
        note.insert(0, f"stopped or failed after {steps} logged optimizer step{'s' if steps != 1 else ''}")
    for name, small in ((figure.FIGURE, False), (figure.THUMBNAIL, True)):
        fig = figure.plot_steps(rows, f"{title} (MLflow run {run_id[:8]}): {steps} optimizer steps", "; ".join(note),
                                thumbnail=small)
        try:
            tracker.log_figure(run_id, fig, name)
        finally:
            import matplotlib.pyplot as plt
            plt.close(fig)
    tracker.set_tags(run_id, {figure.NOTE_TAG: figure.description(run_id)})
