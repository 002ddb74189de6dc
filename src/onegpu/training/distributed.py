"""Data-parallel training over ``train.num_processes`` processes (one per GPU; gloo processes on a CPU).

The train stage launches itself again through ``torch.distributed.run`` (torchrun, which
``accelerate launch`` also uses for several GPUs) when ``train.num_processes`` is above 1 and it is not
already one of a launch's processes (:func:`launch`). Each process then builds its ``Accelerator`` (the
``accelerate`` backend) or ``TrainingArguments`` (the ``trainer`` backend) from torchrun's environment
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``PORT``): NCCL on GPUs, gloo on a CPU.

What stays exact: each rank's loss is its items' summed loss divided by the item count of the whole
optimizer step *over all ranks* (:func:`sum_over_ranks`), multiplied by the number of processes because
DDP averages the ranks' gradients; the sum over ranks of the unscaled values is the step's loss. Each rank
trains on its own shard of the same seeded order (Accelerate's ``BatchSamplerShard``: micro-batch ``i``
of the single-process order goes to rank ``i mod N``), so N x micro x accumulation sees the same examples
in each optimizer step as 1 x (N x micro) x accumulation.

Only rank 0 writes to MLflow and the stage's outputs (:class:`NullTracker` on the others). A rank that
fails ends the launch: torchrun stops the other processes, and :func:`launch` ends the MLflow run
FAILED with the rank named (``error.rank``). Collectives time out after :data:`TIMEOUT_S` seconds.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import tempfile
from pathlib import Path

from onegpu.errors import ConfigError, UserError

# Seconds a collective (all-reduce, barrier) waits for the other ranks before it fails: the process
# group's timeout (Accelerate's InitProcessGroupKwargs, TrainingArguments.ddp_timeout).
TIMEOUT_S = 600
# Exit codes of a process stopped by SIGINT/SIGTERM: the stage's 128 + signal, or killed by the signal.
STOP_EXIT_CODES = (130, 143, -2, -15)
# Seconds torchrun waits after SIGTERM before it SIGKILLs the processes it stops (PContext.close's timeout).
KILL_GRACE_S = 30
# Set by :func:`launch` for its processes: a folder where rank 0 writes ``run.json`` (the MLflow run id).
LAUNCH_DIR_ENV = "ONEGPU_LAUNCH_DIR"


class RankFailed(UserError):
    """One of the launched training processes failed; the others were stopped."""


def world_size() -> int:
    """Processes in this launch (torchrun's ``WORLD_SIZE``); 1 outside a launch."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    """This process's global rank (torchrun's ``RANK``); 0 outside a launch."""
    return int(os.environ.get("RANK", "0"))


def local_rank() -> int:
    """This process's rank on its machine (``LOCAL_RANK``): its GPU index; 0 outside a launch."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def launched() -> bool:
    """Whether this process is one of a multi-process launch's (torchrun or ``accelerate launch``)."""
    return world_size() > 1


def is_main() -> bool:
    """Whether this process writes MLflow and the stage's outputs (rank 0, or the only process)."""
    return rank() == 0


def check_world(num_processes: int) -> None:
    """Inside a launch, its size must be ``train.num_processes`` (the effective batch counts on it).

    Raises:
        ConfigError: launched (e.g. by hand with ``accelerate launch``) with another number of processes.
    """
    if world_size() != num_processes:
        raise ConfigError(f"params.yaml: train.num_processes is {num_processes} but this launch has "
                          f"{world_size()} processes; set train.num_processes: {world_size()} or run "
                          "`onegpu train` without a launcher (it launches itself)")


def launch(num_processes: int, argv: list[str]) -> None:
    """Run ``python -m onegpu <argv>`` in ``num_processes`` processes under ``torch.distributed.run``
    (standalone rendezvous on a free local port) and wait for them.

    Raises:
        RankFailed: a process exited non-zero; the MLflow run (if rank 0 had started one) is ended
            FAILED with ``error.rank``, ``error.exitcode`` and ``error.message`` tags (KILLED stays KILLED);
            the rank named is the cause (:func:`_cause`: a process killed outright before its peers'
            lost-connection errors).
        KeyboardInterrupt: the launch was stopped by a signal (forwarded to the processes once), or every
            process stopped on one (the run is then KILLED, by rank 0).
    """
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    args = torchrun.parse_args(["--standalone", f"--nproc-per-node={num_processes}", "--module", "onegpu", *argv])
    with tempfile.TemporaryDirectory(prefix="onegpu-launch-") as folder:
        os.environ[LAUNCH_DIR_ENV] = folder
        print(f"train: launching {num_processes} processes (torch.distributed.run)", flush=True)
        try:
            torchrun.run(args)
        except ChildFailedError as e:
            noted = _first_noted_failure(Path(folder))
            if noted is None and all(f.exitcode in STOP_EXIT_CODES for f in e.failures.values()):
                # Every process stopped on a signal after its checkpoint (rank 0 ended the run KILLED).
                raise KeyboardInterrupt("every training process stopped on a signal") from None
            failed, exitcode, what = _cause(e.failures, noted)
            message = f"training process rank {failed} of {num_processes} {what}; the other processes were stopped"
            _fail_run(Path(folder), failed, exitcode, message)
            raise RankFailed(message) from None
        except SignalException as e:  # torchrun forwarded it to the processes, which checkpoint and stop
            stopped = KeyboardInterrupt(f"the launch was stopped by {e.sigval.name} (what its processes kept: above)")
            stopped.signum = int(e.sigval)  # the stage exits 128 + it (onegpu.cli)
            raise stopped from None
        finally:
            os.environ.pop(LAUNCH_DIR_ENV, None)


def _cause(failures: dict, noted: dict | None) -> tuple[int, int, str]:
    """``(rank, exit code, what happened)`` of the process that ended a launch, from torchrun's
    ``ProcessFailure`` per rank (exit code; negative = killed by that signal) and the first error a
    process noted itself (:func:`failure_note`).

    A process killed by a signal it could not catch or answer (SIGKILL from the kernel's out-of-memory
    killer, SIGSEGV, SIGABRT, ...: any but SIGINT/SIGTERM, which stop cleanly) notes nothing; its peers
    then fail on the lost connection and note *that*, so such a death is the cause, the earliest first.
    One torchrun sent itself, SIGKILL after its 30 s grace when stopping the others, comes at least that
    long after the first failure and is left out. Otherwise the first noted error, else torchrun's first
    failure.
    """
    first = min(f.timestamp for f in failures.values())
    killed = sorted((f.timestamp, r, f) for r, f in failures.items()
                    if f.exitcode < 0 and f.exitcode not in STOP_EXIT_CODES
                    and f.timestamp < first + KILL_GRACE_S and not (noted and noted["rank"] == r))
    if killed:
        _, r, f = killed[0]
        name = f.signal_name()
        why = (" (not catchable; the usual sender is the kernel's out-of-memory killer: see `dmesg` or "
               "`journalctl -k` for 'Out of memory: Killed process')" if f.exitcode == -signal.SIGKILL else "")
        return r, f.exitcode, f"was killed by signal {name}{why}"
    if noted is not None:  # the rank whose own error came first (the others then lose their peers)
        r = noted["rank"]
        return r, failures[r].exitcode if r in failures else 1, f"failed ({noted['error']})"
    r = min(failures, key=lambda k: failures[k].timestamp)
    f = failures[r]
    return r, f.exitcode, f"failed ({f'signal {f.signal_name()}' if f.exitcode < 0 else f'exit code {f.exitcode}'})"


def announce_run(run_id: str, experiment_name: str) -> None:
    """Rank 0 of a launch: tell :func:`launch` which MLflow run it writes (so a failure of another rank
    ends that run FAILED). A no-op outside a launch."""
    folder = os.environ.get(LAUNCH_DIR_ENV)
    if folder and is_main():
        Path(folder, "run.json").write_text(json.dumps({"run_id": run_id, "experiment_name": experiment_name}))


def _fail_run(folder: Path, failed: int, exitcode: int, message: str) -> None:
    """End the launch's MLflow run FAILED naming rank ``failed`` (unless a stop already ended it KILLED)."""
    info = folder / "run.json"
    if not info.is_file():
        return
    try:
        from onegpu import tracking
        data = json.loads(info.read_text())
        tracker = tracking.connect(data["experiment_name"])
        status = tracker.run_status(data["run_id"])
        tags = {"error.rank": str(failed), "error.exitcode": str(exitcode)}
        if failed != 0 or status != "FAILED":  # rank 0's own error is already in error.message
            tags["error.message"] = message
        tracker.set_tags(data["run_id"], tags)
        if status != "KILLED":
            tracker.end_run(data["run_id"], "FAILED")
    except Exception as e:  # the store is down: the terminal message is what the user needs
        print(f"train: could not mark the MLflow run FAILED: {e}", file=sys.stderr)


@contextlib.contextmanager
def failure_note():
    """In a launch's process: an error raised inside is noted (``failed-<rank>.json``: rank, time,
    error) for :func:`launch`, which names the rank whose error came first, then re-raised."""
    import time
    try:
        yield
    except BaseException as e:
        folder = os.environ.get(LAUNCH_DIR_ENV)
        if folder and launched() and not isinstance(e, KeyboardInterrupt):
            with contextlib.suppress(OSError):
                Path(folder, f"failed-{rank()}.json").write_text(json.dumps(
                    {"rank": rank(), "time": time.time(), "error": f"{type(e).__name__}: {str(e)[:2000]}"}))
        raise


def _first_noted_failure(folder: Path) -> dict | None:
    notes = []
    for f in folder.glob("failed-*.json"):
        with contextlib.suppress(OSError, ValueError):
            notes.append(json.loads(f.read_text()))
    return min(notes, key=lambda n: n["time"]) if notes else None


def sum_over_ranks(tensor):
    """``tensor`` summed over all ranks (in place, then returned); the tensor itself outside a launch.
    One all-reduce: every rank must call it at the same point."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def gather_over_ranks(values: list[float], device) -> list[list[float]]:
    """Every rank's ``values`` (same length on all ranks), indexed by rank: ``[values]`` outside a launch.
    One all-gather (float64 on ``device``)."""
    import torch
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return [list(values)]
    mine = torch.tensor(values, dtype=torch.float64, device=device)
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)
    return [t.tolist() for t in out]


def gather_objects(obj) -> list:
    """Every rank's ``obj`` (picklable: e.g. CPU tensors), indexed by rank; ``[obj]`` outside a launch.
    One ``all_gather_object``: every rank must call it at the same point."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def any_rank(flag: bool, device) -> bool:
    """Whether ``flag`` is true on any rank (a stop requested on one stops all at the same step)."""
    import torch
    t = torch.tensor([1 if flag else 0], dtype=torch.int64, device=device)
    return bool(sum_over_ranks(t).item())


class NullTracker:
    """The tracker of ranks other than 0: same calls as :class:`onegpu.tracking.Tracker`, writes nothing."""
    experiment_id = ""

    def start_run(self, run_name, tags) -> str:
        return ""

    def metric_buffer(self, run_id, *a, **kw):
        return _NullBuffer()

    @contextlib.contextmanager
    def guard(self, run_id, finish=True, context=None):
        yield self

    @contextlib.contextmanager
    def system_metrics(self, run_id, *a, **kw):
        yield

    def find_run(self, run_id):
        return None

    def __getattr__(self, name):  # log_params, set_tags, log_metrics, log_dict, log_text, ...: no-ops
        if name.startswith(("log_", "set_", "end_")):
            return lambda *a, **kw: None
        raise AttributeError(name)


class _NullBuffer:
    def add(self, metrics, step) -> None:
        pass

    def flush(self) -> None:
        pass


def print_main(text: str) -> None:
    """Print ``text`` (flushed) on rank 0 only: one progress line per step, not one per process."""
    if is_main():
        print(text, flush=True)
