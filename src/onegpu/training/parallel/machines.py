"""Checkpoints of a launch over several machines (``train.num_machines`` above 1): one folder, or one per machine.

A training's checkpoints are under the project (``.onegpu/checkpoints/<hash>``, :func:`onegpu.paths.checkpoint_dir`),
and each machine has the project: on storage the machines share (a cluster's NFS home), or on its own disk.
Before any work, :func:`agree` finds out which through the launch's rendezvous store on machine 0: rank 0 leaves
a marker in its checkpoint folder, and every process looks for it in its own.

- **One folder** (every machine sees the marker): as on one machine, rank 0 writes a checkpoint's whole
  weights and its state file (under ``train.fsdp`` every process writes its shards into it).
- **One per machine** (data parallel only): each machine keeps a checkpoint it can resume from its own disk. The
  first process of each machine (local rank 0) writes what rank 0 writes, the whole weights (every process holds
  the same weights and optimizer states), as HF Trainer's ``save_on_each_node`` does. Under ``train.fsdp`` a
  checkpoint is one ``torch.distributed.checkpoint`` of all processes' shards (its metadata, written by rank 0, maps
  every item to one process's file; items that every process holds, the optimizer's step counts, are written by
  one of them), so :func:`agree` refuses folders of their own in one line.

Resuming needs every machine to find the same checkpoint: :func:`agree` refuses machines that found different
ones (or one none) in one line, before any work. (A machine that started afresh beside one that resumed would
train other weights, and wait on a collective the others never make.)
"""
from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

from onegpu import paths
from onegpu.errors import AlreadySaid, ConfigError
from onegpu.training.parallel import distributed

MARKER = ".onegpu-machine-0"  # rank 0's marker in its checkpoint folder, removed once every process looked
TOKEN_KEY = "onegpu/machines/token"  # the rendezvous store's keys
SEEN_KEY = "onegpu/machines/seen/{rank}"

# This process's layout, set by agree(): own_folders is the same on every process of the launch.
_layout = {"own_folders": False, "writes": None}


def writes_checkpoint() -> bool:
    """Whether this process writes the files of a checkpoint that one process writes per folder (the whole
    weights, the scheduler's state, ``onegpu_state.json``): rank 0, and with :func:`own_folders` the first process
    of every machine whose folder is not machine 0's."""
    return distributed.is_main() or bool(_layout["writes"])


def own_folders() -> bool:
    """Whether some machine keeps its checkpoints in a folder of its own (the same answer on every process)."""
    return bool(_layout["own_folders"])


def agree(checkpoint_dir, resume, sharded: bool = False) -> None:
    """In a launch over several machines (torchrun's ``LOCAL_WORLD_SIZE`` below ``WORLD_SIZE``), every process
    calls this before any work: which machines share machine 0's ``checkpoint_dir`` (sets :func:`own_folders`
    and :func:`writes_checkpoint`), and whether every machine found the same checkpoint ``resume`` (a
    :class:`~onegpu.training.lifecycle.resume.ResumePoint` or None). ``sharded``: ``train.fsdp.enabled``. A no-op on
    one machine.

    Raises:
        ConfigError: the machines found different checkpoints, or ``sharded`` and a machine does not share machine
            0's folder (one line naming the machines); :class:`~onegpu.errors.AlreadySaid` with it on a process that
            is not its machine's first (that one prints the line).
    """
    world, local = distributed.world_size(), int(os.environ.get("LOCAL_WORLD_SIZE", distributed.world_size()))
    if local >= world:
        return
    store = distributed._store(distributed.TIMEOUT_S)  # machines start at different times: a collective's wait
    seen = _exchange(store, distributed.rank(), distributed.rank() // local, world, Path(checkpoint_dir), resume)
    mine = seen[distributed.rank()]
    _layout["own_folders"] = not all(s["shared"] for s in seen)
    _layout["writes"] = distributed.local_rank() == 0 and not mine["shared"]
    try:
        if sharded:
            check_one_folder(seen, checkpoint_dir)
        check_same_checkpoint(seen, checkpoint_dir)
    except ConfigError as e:  # every process has the same views: the first of each machine says it
        raise (e if distributed.local_rank() == 0 else AlreadySaid(str(e))) from None


def _exchange(store, rank: int, machine: int, world: int, folder: Path, resume) -> list[dict]:
    """Every process's view, indexed by rank: ``machine``, ``shared`` (it sees rank 0's marker in its ``folder``),
    ``step`` and ``sharded`` of the checkpoint it found (None: none). Rank 0 writes the marker and removes it (and
    the folder, if it made it and nothing else is in it) once every process has looked."""
    marker, made = folder / MARKER, not folder.exists()
    if rank == 0:
        token = f"{os.getpid()}-{time.time_ns()}"
        folder.mkdir(parents=True, exist_ok=True)
        marker.write_text(token)
        store.set(TOKEN_KEY, token)
    token = store.get(TOKEN_KEY).decode()  # waits for rank 0
    shared = False
    with contextlib.suppress(OSError):
        shared = marker.read_text() == token
    store.set(SEEN_KEY.format(rank=rank), json.dumps({
        "machine": machine, "shared": shared, "step": resume.step if resume else None,
        "sharded": resume.sharded if resume else None}))
    keys = [SEEN_KEY.format(rank=r) for r in range(world)]
    store.wait(keys)
    seen = [json.loads(store.get(k)) for k in keys]
    if rank == 0:
        marker.unlink(missing_ok=True)
        if made:
            with contextlib.suppress(OSError):
                folder.rmdir()  # only if empty
    return seen


def check_one_folder(seen: list[dict], checkpoint_dir) -> None:
    """Raises ConfigError unless every machine in ``seen`` (:func:`_exchange`'s views) shares machine 0's folder."""
    apart = sorted({s["machine"] for s in seen if not s["shared"]})
    if apart:
        which = f"machine {apart[0]} does" if len(apart) == 1 else f"machines {', '.join(map(str, apart))} do"
        raise ConfigError(
            f"params.yaml: train.fsdp.enabled: sharding over several machines needs one checkpoint folder that every "
            f"machine sees, and {which} not see machine 0's "
            f"{paths.relative_to_root(checkpoint_dir)} (a sharded checkpoint is one torch.distributed.checkpoint of "
            "every process's shards); keep the project on storage the machines share, or set train.fsdp.enabled: "
            "false (data parallel keeps a checkpoint on each machine)")


def check_same_checkpoint(seen: list[dict], checkpoint_dir) -> None:
    """Raises ConfigError unless every machine in ``seen`` (:func:`_exchange`'s views) found the same checkpoint
    (the same step, and sharded or not alike)."""
    by_machine = {s["machine"]: (s["step"], s["sharded"]) for s in seen}
    if len(set(by_machine.values())) <= 1:
        return

    def found(step, sharded) -> str:
        if step is None:
            return "finds none"
        return f"resumes after optimizer step {step}" + (f" (shards of {sharded} processes)" if sharded else "")
    each = ", ".join(f"machine {m} {found(*v)}" for m, v in sorted(by_machine.items()))
    raise ConfigError(f"train: the machines find different checkpoints of this training "
                      f"({paths.relative_to_root(checkpoint_dir)}): {each}; every machine must resume the same one: "
                      "copy machine 0's folder to the others (or keep the project on storage they share), or delete "
                      "it on every machine to train from the start")
