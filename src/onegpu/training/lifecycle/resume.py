"""Resuming a stopped training: finding the newest resumable checkpoint and onegpu's state file inside it.

Each backend writes ``<checkpoint_dir>/checkpoint-N/`` in its own format (HF Trainer's, or the
Accelerate loop's: :func:`save_loop_state` / :func:`load_loop_state`; under ``train.fsdp``
:func:`save_sharded_state` / :func:`load_sharded_state`); all add ``onegpu_state.json`` last and only
then remove the older checkpoint (:func:`complete`), so a folder without it is a checkpoint that was cut
off (a SIGKILL, a full disk) and is never resumed, and one complete checkpoint is always there. Weights
are safetensors (sharded: ``torch.distributed.checkpoint``'s files, every process its own shards);
optimizer and scheduler states load with ``torch.load(weights_only=True)``; RNG states that are not
tensors (Python's, NumPy's) are JSON.
"""
from __future__ import annotations

import glob
import json
import os
import random
import shutil
from dataclasses import dataclass, field

from onegpu.measure import memory

STATE_FILE = "onegpu_state.json"
SHARDED_DIR = "sharded"  # under train.fsdp: torch.distributed.checkpoint's folder in checkpoint-N


@dataclass(frozen=True)
class ResumePoint:
    """A complete checkpoint to continue from, with onegpu's state as ``onegpu_state.json`` holds it.

    ``path``: the ``checkpoint-N`` folder; ``step``: optimizer steps done (N); ``rows``: the step rows
    recorded so far (:class:`onegpu.training.record.recorder.StepRecorder`); ``breakdown``: the memory breakdown
    (bytes); ``events``: out-of-memory recoveries; ``evals``: the validation points so far
    (:attr:`onegpu.training.record.recorder.StepRecorder.evals`); ``tables``: the objective's tables so far
    (:attr:`~onegpu.training.record.recorder.StepRecorder.tables`); ``run_id``: the MLflow run that wrote it (None when
    unknown); ``micro_batch``, ``accumulation``, ``num_processes``: the split it was trained with (None when not
    recorded); ``sharded``: the number of processes whose shards it holds (None: whole weights).
    """
    path: str
    step: int
    rows: list = field(default_factory=list)
    breakdown: dict = field(default_factory=dict)
    events: list = field(default_factory=list)
    evals: list = field(default_factory=list)
    tables: dict = field(default_factory=dict)
    run_id: str | None = None
    micro_batch: int | None = None
    sharded: int | None = None
    accumulation: int | None = None
    num_processes: int | None = None

    @classmethod
    def from_state(cls, path: str, state: dict) -> ResumePoint:
        """From a folder and its parsed ``onegpu_state.json`` (keys as :func:`write_state` writes them)."""
        def number(key: str) -> int | None:
            return int(state[key]) if state.get(key) else None
        return cls(path=path, step=int(state["step"]), rows=list(state.get("rows", [])),
                   breakdown=dict(state.get("breakdown", {})), events=list(state.get("events", [])),
                   evals=list(state.get("evals", [])), tables=dict(state.get("tables", {})),
                   run_id=state.get("run_id") or None,
                   micro_batch=number("micro_batch"), sharded=number("sharded"),
                   accumulation=number("gradient_accumulation_steps"),
                   num_processes=number("num_processes") or number("sharded"))

    def other_split(self, micro_batch: int, accumulation: int, num_processes: int) -> str:
        """A clause saying that this checkpoint was written with another split than ``micro_batch`` x
        ``accumulation`` x ``num_processes`` (a sharded one's shards redistributed on load); "" when it was the same
        or is not recorded."""
        was = (self.micro_batch, self.accumulation, self.num_processes)
        if None in was or was == (micro_batch, accumulation, num_processes):
            return ""
        per_step = micro_batch * accumulation * num_processes
        return (f"; written by {was[2]} process(es) of {was[0]} x {was[1]}, it goes on with {num_processes} of "
                f"{micro_batch} x {accumulation}: the same effective batch of {per_step}"
                + (", its shards redistributed on load" if self.sharded else ""))


def latest_checkpoint(checkpoint_dir) -> ResumePoint | None:
    """The newest complete ``checkpoint-N`` under ``checkpoint_dir`` as a :class:`ResumePoint`; None when
    there is none."""
    found = []
    for d in glob.glob(os.path.join(str(checkpoint_dir), "checkpoint-*")):
        try:
            found.append((int(d.rsplit("-", 1)[1]), d))
        except ValueError:
            continue
    for _, d in sorted(found, reverse=True):
        state = os.path.join(d, STATE_FILE)
        if os.path.isfile(state):
            with open(state) as f:
                return ResumePoint.from_state(d, json.load(f))
    return None


def complete(checkpoint: str, step: int, recorder, meta: dict) -> None:
    """Make ``checkpoint`` (a folder whose backend files are all written) the one to resume: write
    ``onegpu_state.json`` into it (atomically: the last file of a checkpoint), then remove every other
    ``checkpoint-*`` beside it. In that order, a process killed at any moment (SIGKILL after a
    scheduler's grace period) leaves a complete checkpoint behind: the new one, or the one before it.

    Raises:
        DiskFullError: no space for the state file (the previous checkpoint is still there).
    """
    from onegpu.paths import write_json_atomic
    write_json_atomic(os.path.join(checkpoint, STATE_FILE), {
        "step": step, "rows": recorder.rows, "breakdown": recorder.breakdown, "events": recorder.events,
        "evals": recorder.evals, **({"tables": recorder.tables} if getattr(recorder, "tables", None) else {}), **meta})
    for old in glob.glob(os.path.join(os.path.dirname(checkpoint), "checkpoint-*")):
        if os.path.abspath(old) != os.path.abspath(checkpoint):
            shutil.rmtree(old, ignore_errors=True)


def save_loop_state(checkpoint_dir, step: int, model, optimizer, scheduler, recorder, meta: dict) -> str:
    """The Accelerate loop's checkpoint after optimizer step ``step`` (:func:`complete`: older ones
    are removed once it is whole).

    Raises:
        DiskFullError: the disk filled up while writing it (the previous checkpoint is still there).
    """
    import torch
    from safetensors.torch import save_model

    from onegpu.paths import writing
    d = os.path.join(str(checkpoint_dir), f"checkpoint-{step}")
    with writing(d):
        os.makedirs(d, exist_ok=True)
        save_model(model, os.path.join(d, "model.safetensors"))  # handles tied weights
        torch.save(optimizer.state_dict(), os.path.join(d, "optimizer.pt"))
        torch.save(scheduler.state_dict(), os.path.join(d, "scheduler.pt"))
        _save_rng(d, "")
    complete(d, step, recorder, meta)
    return d


def save_sharded_state(checkpoint_dir, step: int, model, optimizer, scheduler, recorder, meta: dict) -> str:
    """Under ``train.fsdp``, the checkpoint after optimizer step ``step``; every process calls it (collective).

    The model's and the optimizer's sharded state (``get_state_dict``) go through ``torch.distributed.checkpoint``
    into ``checkpoint-N/sharded/`` (``dcp.save``: each process writes its own shards, process 0 the metadata
    last); each process writes its RNG states (``rng_state-rank<r>.*``), process 0 the scheduler's. Only once
    every process is done (a barrier) does process 0 write ``onegpu_state.json`` (with ``sharded``: the
    number of processes) and remove the older checkpoints (:func:`complete`): a stop or a SIGKILL mid-save
    leaves the previous checkpoint the newest complete one. Returns the folder.

    Raises:
        DiskFullError: the disk filled up while writing it (the previous checkpoint is still there).
    """
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from onegpu.paths import writing
    d = os.path.join(str(checkpoint_dir), f"checkpoint-{step}")
    rank = dist.get_rank()
    with writing(d):
        os.makedirs(d, exist_ok=True)
        _save_rng(d, f"-rank{rank}")
        model_state, optimizer_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=os.path.join(d, SHARDED_DIR))
        if rank == 0:
            torch.save(scheduler.state_dict(), os.path.join(d, "scheduler.pt"))
    dist.barrier()  # every process's files are written
    if rank == 0:
        complete(d, step, recorder, {**meta, "sharded": dist.get_world_size()})
    dist.barrier()  # no process goes on (or stops) before the checkpoint is complete
    return d


def _save_rng(d: str, suffix: str) -> None:
    """This process's torch (and CUDA), Python and NumPy RNG states into ``d``: ``rng_state<suffix>.pt`` and
    ``rng_state<suffix>.json``."""
    import numpy as np
    import torch
    rng = {"cpu": torch.get_rng_state()}
    if memory.cuda_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    torch.save(rng, os.path.join(d, f"rng_state{suffix}.pt"))
    np_state = np.random.get_state()
    with open(os.path.join(d, f"rng_state{suffix}.json"), "w") as f:
        json.dump({"python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
                   "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]]}, f)


def load_loop_state(checkpoint: str, model, optimizer, scheduler) -> None:
    """Restore weights, optimizer and scheduler that :func:`save_loop_state` wrote (RNG: :func:`load_rng`)."""
    import torch
    from safetensors.torch import load_model
    load_model(model, os.path.join(checkpoint, "model.safetensors"))
    optimizer.load_state_dict(torch.load(os.path.join(checkpoint, "optimizer.pt"), weights_only=True))
    scheduler.load_state_dict(torch.load(os.path.join(checkpoint, "scheduler.pt"), weights_only=True))


def load_sharded_state(checkpoint: str, model, optimizer, scheduler) -> None:
    """Restore what :func:`save_sharded_state` wrote into the sharded ``model`` and its ``optimizer`` (every
    process, collective: ``dcp.load`` into this process's ``get_state_dict``, then ``set_state_dict``) and the
    ``scheduler`` (RNG: :func:`load_rng`), on any number of processes: ``dcp.load`` reads each process's part of
    every tensor from the files of whichever processes wrote it (resharding), and items every process holds (the
    optimizer's step counts) from the one file they were written to. The session finds it by the effective batch
    (:func:`onegpu.equivalence.key.run_config_hash`)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=os.path.join(checkpoint, SHARDED_DIR))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    scheduler.load_state_dict(torch.load(os.path.join(checkpoint, "scheduler.pt"), weights_only=True))


def load_rng(checkpoint: str) -> None:
    """Restore the torch, CUDA, Python and NumPy RNG states (this process's own, where the checkpoint has one
    per process: :func:`save_sharded_state`; process 0's for a process the checkpoint has none of, resumed on more
    processes than wrote it: every process seeds alike, ``train.seed``). Call right before the next optimizer
    step: anything that draws in between (a DataLoader iterator draws its base seed) would shift dropout."""
    import numpy as np
    import torch
    import torch.distributed as dist
    suffix = f"-rank{dist.get_rank()}" if dist.is_available() and dist.is_initialized() else ""
    if not os.path.isfile(os.path.join(checkpoint, f"rng_state{suffix}.pt")):
        # one set for every process (save_loop_state's: process 0's), or a sharded one's process 0's
        suffix = "" if os.path.isfile(os.path.join(checkpoint, "rng_state.pt")) else "-rank0"
    rng = torch.load(os.path.join(checkpoint, f"rng_state{suffix}.pt"), weights_only=True)
    torch.set_rng_state(rng["cpu"])
    if "cuda" in rng and memory.cuda_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    with open(os.path.join(checkpoint, f"rng_state{suffix}.json")) as f:
        other = json.load(f)
    random.setstate((other["python"][0], tuple(other["python"][1]), other["python"][2]))
    n = other["numpy"]
    np.random.set_state((n[0], np.asarray(n[1], dtype=np.uint32), *n[2:]))


def review_other_checkpoints(own_dir, key: str, params: dict, fingerprint: str, get_run) -> list[dict]:
    """What to do with the checkpoints of *other* training configurations, found next to ``own_dir``
    (``.onegpu/checkpoints/<config hash>/``, one folder per configuration).

    A checkpoint is resumed only by a run of its configuration (any split of its effective batch:
    :func:`onegpu.equivalence.key.run_config_hash`), so a run with another seed, learning rate or effective batch
    starts afresh and never uses it. The rule, from the MLflow run named in the newest
    complete checkpoint of each folder (``get_run(run_id)``: the run, or None when it is not in the store):

    - ``in use``: that run, or the run that resumed it (tag ``onegpu.resumed_by``), is RUNNING: kept.
    - ``prune`` now: the run is deleted in MLflow, or it FINISHED or is SCHEDULED (a finished training removes its own
      checkpoints; what is left cannot be resumed into anything).
    - ``superseded``: the run was stopped (KILLED/FAILED) and has this run's ``equivalence_key``: this
      run trains the same thing another way (another backend, checkpointing granularity, ...). Said at the start;
      pruned when this run finishes.
    - ``kept``: stopped, another equivalence key (or the run is not in this store): it can still save
      work for a rerun of that configuration. Said at the start; kept until its run is deleted in MLflow
      or a run of its equivalence key finishes.
    Folders with no complete checkpoint are left alone (a run may be writing its first one).

    Args:
        own_dir: this configuration's folder (never judged).
        key: this run's equivalence key; params: this run's params (``config.flatten``), to name what
            differs; fingerprint: this run's data fingerprint.
        get_run: run id -> MLflow run (``.info.status``, ``.info.lifecycle_stage``, ``.data.tags``,
            ``.data.params``) or None.
    Returns:
        One dict per other folder with a complete checkpoint: ``folder``, ``step``, ``run_id``, ``action``
        (one of the four above) and ``message`` (one line for the terminal; empty for ``in use``).
    """
    from pathlib import Path
    own = Path(own_dir).resolve()
    out = []
    for folder in sorted(Path(own_dir).parent.glob("*")):
        if not folder.is_dir() or folder.resolve() == own:
            continue
        found = latest_checkpoint(folder)
        if found is not None:
            out.append(_judge(folder, found, key, params, fingerprint, get_run))
    return out


def tidy_other_checkpoints(own_dir, key: str, params: dict, fingerprint: str, get_run, announce: bool = False,
                           finished: bool = False) -> None:
    """Say which checkpoints of other configurations this run does not use (``announce``, one printed
    line each) and remove those nothing can resume: at the start the ones whose run is deleted or
    finished, after a finished training (``finished``) also the stopped runs of the same equivalence key.
    The rule and the arguments: :func:`review_other_checkpoints`. Never stops training: a store or disk
    error skips it."""
    try:
        items = review_other_checkpoints(own_dir, key, params, fingerprint, get_run)
    except Exception:
        return
    for item in items:
        if item["action"] == "prune" or (finished and item["action"] == "superseded"):
            shutil.rmtree(item["folder"], ignore_errors=True)
            msg = item["message"] if item["action"] == "prune" else (
                f"removed the checkpoint of stopped MLflow run {item['run_id']} at optimizer step {item['step']} "
                f"({item['folder']}): this run finished the same training (equivalence key {key})")
            print(f"train: {msg}", flush=True)
        elif announce and item["message"]:
            print(f"train: {item['message']}", flush=True)


def _judge(folder, found: ResumePoint, key: str, params: dict, fingerprint: str, get_run) -> dict:
    """One item of :func:`review_other_checkpoints` for ``folder`` and its newest complete checkpoint."""
    step, run_id = found.step, found.run_id or ""
    run = get_run(run_id) if run_id else None
    item = {"folder": folder, "step": step, "run_id": run_id}
    what = f"the checkpoint of stopped MLflow run {run_id} at optimizer step {step} ({folder})"
    if run is None:
        return {**item, "action": "kept", "message": (
            f"{what} is for another configuration and was not used; its run is not in "
            "this store; kept (delete the folder to drop it)")}
    tags = run.data.tags
    successor = tags.get("onegpu.resumed_by")
    succ = get_run(successor) if successor else None
    if run.info.status == "RUNNING" or (succ is not None and succ.info.status == "RUNNING"):
        return {**item, "action": "in use", "message": ""}
    if run.info.lifecycle_stage == "deleted" or run.info.status in ("FINISHED", "SCHEDULED"):
        why = "its run is deleted in MLflow" if run.info.lifecycle_stage == "deleted" else "its run finished"
        return {**item, "action": "prune",
                "message": f"removed {what.replace('stopped ', '')}: {why}, nothing can resume it"}
    differs = _differences(run.data.params, params, tags.get("data.fingerprint"), fingerprint)
    if tags.get("equivalence_key") == key:
        return {**item, "action": "superseded", "message": (
            f"{what} is for another configuration ({differs}) and was not used; this run trains the same "
            "(equivalence key) and removes it when it finishes")}
    return {**item, "action": "kept", "message": (
        f"{what} is for another configuration ({differs}) and was not used; kept for a rerun of "
        "that configuration (delete its MLflow run, or the folder, to drop it)")}


# Params that do not enter onegpu.equivalence.run_config_hash: never why a checkpoint was not used.
_NOT_IN_HASH = ("tracking.", "evaluate.", "train.logging_steps", "train.save_steps")


def _differences(theirs: dict, ours: dict, their_data: str | None, our_data: str, most: int = 3) -> str:
    """``key there -> here`` for the first ``most`` params that differ (what a reader needs to see why)."""
    diff = [f"{k} {theirs[k]} there, {ours[k]} here" for k in sorted(ours)
            if k in theirs and str(ours[k]) != theirs[k] and not k.startswith(_NOT_IN_HASH)]
    if their_data and their_data != our_data:
        diff.insert(0, "other data")
    if not diff:
        return "a setting that is not a logged param differs"
    return "; ".join(diff[:most]) + (f"; {len(diff) - most} more" if len(diff) > most else "")
