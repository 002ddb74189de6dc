"""One training run into MLflow, as the train stage, ``onegpu tradeoffs``' worker and ``bench/`` run it:
:func:`run` on a :func:`onegpu.training.session.plan`.

:func:`run` opens the MLflow run (named from its settings, :func:`onegpu.training.record.run_tags.config_name`),
builds the model (:func:`onegpu.training.session.build_model`), finds the ``auto`` micro-batch and logs
its probes, trains (:func:`onegpu.training.session.train`, the host allocator set once), logs what the
recorder measured (:func:`onegpu.training.record.run_tags.log_results`) and hands the result to the caller's
``save`` inside the run's guard (an error there fails the run). On the way out, finished or not, it logs
the outside load and the run's figure (:mod:`onegpu.training.record.closing_record`); after a finished training
it removes the checkpoints nothing can resume.

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

from onegpu import paths, tracking
from onegpu.config import resolve, with_layout
from onegpu.data import describe
from onegpu.equivalence import resolved_params
from onegpu.formatting import gib
from onegpu.measure import memory, outside_load
from onegpu.models import loader, record
from onegpu.training import objectives, session
from onegpu.training.lifecycle.interrupt import GracefulStop, Interrupted
from onegpu.training.lifecycle.resume import latest_checkpoint, tidy_other_checkpoints
from onegpu.training.memory import autobatch, checkpointing, host_allocator
from onegpu.training.parallel import distributed, machines
from onegpu.training.parallel.sharding import per_rank_bytes
from onegpu.training.record.closing_record import closing_record, own_tree_root, reaped_figure
from onegpu.training.record.recorder import step_metrics
from onegpu.training.record.run_tags import CONFIG_TAG, config_name, log_results
from onegpu.training.session import TrainPlan

_BUDGET_CPU = ("; on a CPU the budget covers the training state: params, grads, optimizer states and "
               "activations, not the whole process")


@dataclass
class TrainResult:
    """A finished training: the model and tokenizer to save, the step recorder (``steps.rows``), the
    summary metrics logged to the run, the plan with its final layout, the MLflow run and experiment ids,
    ``saved_config`` (model config values to put back before saving, e.g. ``use_cache``) and
    ``train_s`` (wall seconds inside the backend's ``train``) and ``outside_load`` (what other processes
    took of the machine meanwhile, :mod:`onegpu.measure.outside_load`; None when unmeasured) and
    ``model_spec`` (the run's logged model, :func:`onegpu.models.record.logged_model`)."""
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
    model_spec: tracking.ModelSpec | None = None


def run(plan: TrainPlan, tracker, dsd, save: Callable[[TrainResult], None] | None = None,
        built: tuple | None = None, name: str | None = None, probe: bool = False,
        tokenizer=None) -> TrainResult:
    """The whole training run into ``tracker``'s store (a ``tracking.connect`` handle).

    ``dsd``: the prepared ``DatasetDict``; ``save``: writes the outputs from the result, inside the run's
    guard; ``built``: a ``(model, tokenizer)`` to train instead of :func:`onegpu.training.session.build_model`'s
    (benchmarks); ``name``: the MLflow run name (None: the DVC experiment's, else
    :func:`onegpu.training.record.run_tags.config_name`); ``probe``: a probe row of ``onegpu tradeoffs``
    (``plan.resume`` None): no resumable checkpoints, every checkpoint folder left alone, no figure (the
    batch's report plots the rows); ``tokenizer``: the one prepare used (None: the model's).
    Signals are handled from the start to the end of the run's record (:class:`GracefulStop`).
    Returns:
        The :class:`TrainResult`; the run is left SCHEDULED.
    Raises:
        onegpu.training.lifecycle.interrupt.Interrupted: stopped on a signal, with the run id, the steps logged and
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
    load = outside_load.Watch(plan.device, own_tree_root())

    def sink(metrics: dict, step: int) -> None:
        rows.append((step, metrics))
        buffer.add(metrics, step)

    def context() -> dict:  # the step a failure came in, on the FAILED run
        return {"error.step": str(_progress(plan, rows)[0] + 1)}

    with tracker.guard(run_id, finish="SCHEDULED", context=context), _flushed(buffer), \
            closing_record(tracker, run_id, rows, load, config_name(plan.cfg), figure_too=not probe,
                           kept=lambda: getattr(latest_checkpoint(plan.checkpoint_dir), "step", None)):
        tracker.log_params(run_id, plan.params)
        if "format" in plan.stats:  # the splits it trains on, as prepare's run logged them (same digests)
            tracker.log_data_inputs(run_id, describe.inputs(dsd, plan.stats["format"], plan.cfg.data.source,
                                                            TRAINING_INPUTS), paths.dvc_version())
        model, tokenizer = built or session.build_model(plan.cfg, plan.model_path, plan.stats, tokenizer)
        tracker.set_tags(run_id, loader.describe(model))
        # Training switches the KV cache off (Trainer and checkpointing); the saved model gets it back.
        saved_config = {"use_cache": model.config.use_cache} if hasattr(model.config, "use_cache") else {}
        plan = _with_layout(plan, model, tokenizer, dsd, tracker, run_id)
        for row in (plan.resume.rows if plan.resume else []):  # the stopped run's steps, so this one is whole
            sink(step_metrics(row), row["step"])
        for point in (plan.resume.evals if plan.resume else []):  # and its validation points
            sink({k: v for k, v in point.items() if k != "step"}, point["step"])
        tracker.set_tags(run_id, {"cpu_allocator": host_allocator.apply(plan.cfg.train.cpu_allocator, plan.device)})
        with tracker.system_metrics(run_id), _tables_logged(tracker, run_id, plan.cfg, model):
            load.start()
            t0 = time.perf_counter()
            built_model = model
            model, steps = session.train(plan, model, tokenizer, dsd, sink, run_id, checkpoints=not probe, stop=stop)
            train_s = time.perf_counter() - t0
            load.stop()
        tracker.set_tags(run_id, objectives.of(plan.cfg).run_tags(built_model))  # e.g. DPO's reference
        summary = log_results(plan, tracker, run_id, buffer, model, steps)
        spec = record.logged_model(plan.cfg, plan.key, tracking.run_name() or config_name(plan.cfg))
        if steps.best is not None:  # the model holds the best point's weights, not the last's
            spec.params.update({"best_step": str(steps.best["step"]),
                                steps.best["metric"]: f"{steps.best['value']:.6g}"})
        result = TrainResult(model, tokenizer, steps, summary, plan, run_id, tracker.experiment_id,
                             saved_config, train_s, load.result, spec)
        if save is not None:  # the stage's outputs, then the model in them as the run's logged model
            save(result)
            tracker.log_model(run_id, result.model_spec)
    return result


@contextlib.contextmanager
def _tables_logged(tracker, run_id: str, cfg, model):
    """Around the training of ``model`` (as built): the objective's tables (GRPO's completions,
    :meth:`~onegpu.training.objectives.base.Objective.run_tables`) logged into the run when it ends, however it
    ends, so a stopped or failed run keeps the rows of the steps it trained; on an error, a failure to log them
    is not raised over it."""
    def log() -> None:
        for artifact, table in objectives.of(cfg).run_tables(model).items():
            if table:
                tracker.log_table(run_id, table, artifact)
    try:
        yield
    except BaseException:
        with contextlib.suppress(Exception):
            log()
        raise
    log()


# The splits a training run reads, and their MLflow dataset contexts (Tracker.log_data_inputs: prepare's
# names and tables, so the same digests; the DVC-tracked version read as the input's tag).
TRAINING_INPUTS = {"train": "training", "validation": "validation"}



def _progress(plan: TrainPlan, rows: list) -> tuple[int, float | None, int | None]:
    """``(optimizer steps done, median seconds per step, newest checkpoint's step)`` from the sink's
    ``rows``: the checkpoint is the resumed one or the last multiple of ``train.save_steps`` (None: none yet)."""
    steps = sorted({s for s, _ in rows})
    times = sorted(m["step_time_s"] for _, m in rows if m.get("step_time_s") is not None)
    done = steps[-1] if steps else (plan.resume.step if plan.resume else 0)
    every = plan.cfg.train.save_steps
    saved = max((done // every) * every if every else 0, plan.resume.step if plan.resume else 0)
    return done, times[len(times) // 2] if times else None, saved or None


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


def _tidy_checkpoints(plan: TrainPlan, tracker, stop: GracefulStop, probe: bool) -> None:
    """After a finished training (rank 0 of a launch): nothing is left to resume, so this configuration's
    checkpoints go, and the stopped runs' of the same equivalence key. Kept when a signal came while the
    run's record was written: the command that started the stage may be gone (a terminal's SIGHUP and a
    SIGTERM to the group end DVC at once, before it records the stage), and the next one resumes from them."""
    if probe or not distributed.is_main():  # one process tidies the checkpoints (the others write no MLflow either)
        if not probe and machines.writes_checkpoint() and not stop.noted:  # a machine's own folder: finished
            shutil.rmtree(plan.checkpoint_dir, ignore_errors=True)
        return
    if stop.noted:
        names = ", ".join(sorted({signal.Signals(n).name for n in stop.noted}))
        kept = latest_checkpoint(plan.checkpoint_dir)
        print(f"train: {names} came after the training finished: its outputs and MLflow run are complete; if "
              "the command that started it ended too, DVC has not recorded the stage and a rerun trains again"
              + (f", from the checkpoint of step {kept.step} (kept)" if kept else
                 " from the start (no checkpoint: train.save_steps writes them)"), flush=True)
        return
    shutil.rmtree(plan.checkpoint_dir, ignore_errors=True)  # finished: nothing left to resume
    tidy_other_checkpoints(plan.checkpoint_dir, plan.key, plan.params, plan.fingerprint,
                           tracker.find_run, finished=True)


def _start_run(plan: TrainPlan, tracker, name: str | None = None, tidy: bool = True) -> str:
    """Say which other checkpoints this run does not use (``tidy``), start the MLflow run ``name`` (None:
    the DVC experiment's, else the settings') with the stage's tags and link it to the run it resumes.
    Returns the run id."""
    if not distributed.is_main():  # only rank 0 of a multi-process launch writes to MLflow
        return tracker.start_run(None, {})
    tags = {**tracking.run_context_tags(), "stage": "train", "equivalence_key": plan.key,
            "device": memory.device_name(plan.device), "data.fingerprint": plan.fingerprint}
    if tidy:
        tidy_other_checkpoints(plan.checkpoint_dir, plan.key, plan.params, plan.fingerprint,
                               tracker.find_run, announce=True)
    resume = plan.resume
    if resume:
        tags["onegpu.resumed_from"] = resume.run_id or ""
        tags["onegpu.resumed_at_step"] = str(resume.step)
    tags[CONFIG_TAG] = config_name(plan.cfg)
    run_id = tracker.start_run(name or tracking.run_name() or tags[CONFIG_TAG], tags,
                               on_reaped=reaped_figure(tracker))
    distributed.announce_run(run_id, plan.cfg.tracking.experiment_name)
    if resume:
        r = plan.resolved
        split = r and resume.other_split(r.per_device_train_batch_size, r.gradient_accumulation_steps, r.world_size)
        print(f"train: resuming from {resume.path} (optimizer step {resume.step} of MLflow run "
              f"{resume.run_id}, which was stopped); this run is {run_id}{split or ''}")
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
    """Run the ``auto`` finder (:mod:`onegpu.training.memory.autobatch`) on ``model`` (moved to ``plan.device``,
    checkpointed as configured) within ``plan.budget`` bytes; print and log its probes
    (``auto_micro_batch.json``, ``auto_micro_batch.md``). Returns the micro-batch, the smallest over ranks."""
    cfg, device, budget = plan.cfg, plan.device, plan.budget
    parts = objectives.training_parts(dsd, cfg, tokenizer, with_length=True)
    model.to(device)
    loader.no_kv_cache(model)  # as training runs it
    if cfg.train.gradient_checkpointing:
        checkpointing.enable(model, cfg.train)
    t = cfg.train
    world, sharded = t.num_processes, t.fsdp.enabled
    micro, probes = autobatch.find_micro_batch(
        model, parts.rows, parts.collator, parts.loss,
        t.effective_batch_size, budget, t.optim, device, world_size=world,
        mixed_precision=t.mixed_precision,  # probe under the training's autocast
        extra_bytes=sum(objectives.of(cfg).memory_terms(model).values()),  # a DPO reference copy
        states_at=(lambda m: per_rank_bytes(model, world, t.effective_batch_size // (m * world), t.optim,
                                            t.fsdp.reshard_after_forward)) if sharded else None)
    micro = int(min(r[0] for r in distributed.gather_over_ranks([micro], device)))  # one split for all ranks
    table = autobatch.format_probes(probes)
    procs = f" x {world} processes" if world > 1 else ""
    whose = " per rank: its FSDP2 shards of the states and the gathered weights, predicted" if sharded else ""
    distributed.print_main(
        f"auto micro-batch: {micro} x {t.effective_batch_size // (micro * world)} accumulation{procs} = "
        f"{t.effective_batch_size} (budget {gib(budget)}{whose}, longest training rows"
        f"{_BUDGET_CPU if not memory.is_cuda(device) else ''})\n{table}")
    tracker.log_dict(run_id, {"budget_bytes": budget, "probes": [p.as_row() for p in probes]},
                     "auto_micro_batch.json")
    tracker.log_text(run_id, table + "\n", "auto_micro_batch.md")
    return micro
