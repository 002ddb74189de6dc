"""Resumable checkpoints: finding the newest one and onegpu's state file inside it.

Each backend writes ``<checkpoint_dir>/checkpoint-N/`` in its own format (HF Trainer's, or the
Accelerate loop's: :func:`save_loop_state` / :func:`load_loop_state`); both add ``onegpu_state.json``
last, so a folder without it is a checkpoint that was cut off and is never resumed. Weights are
safetensors; optimizer and scheduler states load with ``torch.load(weights_only=True)``; RNG states
that are not tensors (Python's, NumPy's) are JSON.
"""
from __future__ import annotations

import glob
import json
import os
import random
import shutil

STATE_FILE = "onegpu_state.json"


def latest_checkpoint(checkpoint_dir) -> tuple[str, dict] | None:
    """The newest complete ``checkpoint-N`` under ``checkpoint_dir`` and its onegpu state (the step rows
    so far, the memory breakdown, the MLflow run id, the micro-batch); None when there is none."""
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
                return d, json.load(f)
    return None


def write_state(checkpoint: str, step: int, recorder, meta: dict) -> None:
    """Write ``onegpu_state.json`` into ``checkpoint`` (atomically): the last file of a checkpoint."""
    from onegpu.paths import write_json_atomic
    write_json_atomic(os.path.join(checkpoint, STATE_FILE), {
        "step": step, "rows": recorder.rows, "breakdown": recorder.breakdown, "events": recorder.events, **meta})


def save_loop_state(checkpoint_dir, step: int, model, optimizer, scheduler, recorder, meta: dict) -> str:
    """The Accelerate loop's checkpoint after optimizer step ``step``; older ones are removed."""
    import numpy as np
    import torch
    from safetensors.torch import save_model
    d = os.path.join(str(checkpoint_dir), f"checkpoint-{step}")
    os.makedirs(d, exist_ok=True)
    save_model(model, os.path.join(d, "model.safetensors"))  # handles tied weights
    torch.save(optimizer.state_dict(), os.path.join(d, "optimizer.pt"))
    torch.save(scheduler.state_dict(), os.path.join(d, "scheduler.pt"))
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    torch.save(rng, os.path.join(d, "rng_state.pt"))
    np_state = np.random.get_state()
    with open(os.path.join(d, "rng_state.json"), "w") as f:
        json.dump({"python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
                   "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]]}, f)
    write_state(d, step, recorder, meta)
    for old in glob.glob(os.path.join(str(checkpoint_dir), "checkpoint-*")):
        if old != d:
            shutil.rmtree(old, ignore_errors=True)
    return d


def load_loop_state(checkpoint: str, model, optimizer, scheduler) -> None:
    """Restore weights, optimizer and scheduler that :func:`save_loop_state` wrote (RNG: :func:`load_rng`)."""
    import torch
    from safetensors.torch import load_model
    load_model(model, os.path.join(checkpoint, "model.safetensors"))
    optimizer.load_state_dict(torch.load(os.path.join(checkpoint, "optimizer.pt"), weights_only=True))
    scheduler.load_state_dict(torch.load(os.path.join(checkpoint, "scheduler.pt"), weights_only=True))


def load_rng(checkpoint: str) -> None:
    """Restore the torch, CUDA, Python and NumPy RNG states. Call right before the next optimizer step:
    anything that draws in between (a DataLoader iterator draws its base seed) would shift dropout."""
    import numpy as np
    import torch
    rng = torch.load(os.path.join(checkpoint, "rng_state.pt"), weights_only=True)
    torch.set_rng_state(rng["cpu"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    with open(os.path.join(checkpoint, "rng_state.json")) as f:
        other = json.load(f)
    random.setstate((other["python"][0], tuple(other["python"][1]), other["python"][2]))
    n = other["numpy"]
    np.random.set_state((n[0], np.asarray(n[1], dtype=np.uint32), *n[2:]))
