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

More than one machine (:class:`Machines`, accelerate's ``num_machines``, ``machine_rank``, ``main_process_ip``,
``main_process_port``): ``onegpu train`` runs on every machine, each launcher starting its share of the
processes under torchrun's static rendezvous on machine 0 (:func:`torchrun_args`), so that machine
``machine_rank`` holds the global ranks ``machine_rank x share ..`` and rank 0, which writes the outputs and the
MLflow run, is on machine 0. A rank's own error is also written to the rendezvous store (:func:`failure_note`),
where rank 0 reads it when it fails on the lost peer: machine 0's launcher names the rank of another machine.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from onegpu.errors import AlreadySaid, ConfigError, UserError

# Seconds a collective (all-reduce, barrier) waits for the other ranks before it fails: the process
# group's timeout (Accelerate's InitProcessGroupKwargs, TrainingArguments.ddp_timeout).
TIMEOUT_S = 600
# Exit codes of a process stopped by SIGINT/SIGTERM: the stage's 128 + signal, or killed by the signal.
STOP_EXIT_CODES = (130, 143, -2, -15)
# Seconds torchrun waits after SIGTERM before it SIGKILLs the processes it stops (PContext.close's timeout).
KILL_GRACE_S = 30
# Set by :func:`launch` for its processes: a folder where rank 0 writes ``run.json`` (the MLflow run id).
LAUNCH_DIR_ENV = "ONEGPU_LAUNCH_DIR"
# Seconds rank 0, failing in a launch over several machines, waits for another rank's note in the store.
NOTE_WAIT_S = 2.0
# The rendezvous store's keys of the ranks' failure notes (:func:`failure_note`).
NOTE_KEY = "onegpu/failed/{rank}"
# What gloo and NCCL say when the process at the other end of a collective is gone (its machine's launcher, not
# this one, knows why: a process killed outright there notes nothing that reaches machine 0).
LOST_PEER_SIGNS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                   "remote process exited", "Socket Timeout")


@dataclass(frozen=True)
class Machines:
    """Where a launch's processes run: accelerate's ``num_machines``, ``machine_rank``, ``main_process_ip`` and
    ``main_process_port`` (``train.*``), and ``run_id``, torchrun's ``--rdzv-id`` (the same on every machine)."""
    num_machines: int = 1
    machine_rank: int = 0
    main_process_ip: str | None = None
    main_process_port: int | None = None
    run_id: str = "onegpu"


def torchrun_args(num_processes: int, machines: Machines = Machines()) -> list[str]:
    """torchrun's options for ``num_processes`` processes over all machines (accelerate's meaning), before the
    module: ``--standalone`` on one machine (a free local port); over several, ``num_processes / num_machines``
    per machine under the static rendezvous on ``main_process_ip:main_process_port`` (accelerate's default
    ``rdzv_backend: static``; torch's c10d rendezvous orders machines by address and process id, not
    ``--node-rank``, so rank 0 could land on another machine than the one whose outputs DVC keeps)."""
    if machines.num_machines == 1:
        return ["--standalone", f"--nproc-per-node={num_processes}"]
    from onegpu.config import DEFAULT_MAIN_PROCESS_PORT
    port = machines.main_process_port or DEFAULT_MAIN_PROCESS_PORT
    return [f"--nnodes={machines.num_machines}", f"--node-rank={machines.machine_rank}",
            f"--nproc-per-node={num_processes // machines.num_machines}", "--rdzv-backend=static",
            f"--master-addr={machines.main_process_ip}", f"--master-port={port}", f"--rdzv-id={machines.run_id}",
            "--max-restarts=0"]


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


def launch(num_processes: int, argv: list[str], machines: Machines = Machines()) -> None:
    """Run ``python -m onegpu <argv>`` in ``num_processes`` processes under ``torch.distributed.run``
    (standalone rendezvous on a free local port; this machine's share over several :class:`Machines`, whose
    launchers each call this) and wait for them.

    Raises:
        AlreadySaid: every process exited 2 on bad input before any work, each having printed its one line.
        RankFailed: a process exited non-zero; the MLflow run (if rank 0 had started one) is ended
            FAILED with ``error.rank``, ``error.exitcode`` and ``error.message`` tags (KILLED stays KILLED);
            the rank named is the cause (:func:`_cause`: a process killed outright before its peers'
            lost-connection errors).
        KeyboardInterrupt: the launch was stopped by a signal (forwarded to the processes once), or every
            process stopped on one (the run is then KILLED, by rank 0).
    """
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    args = torchrun.parse_args([*torchrun_args(num_processes, machines), "--module", "onegpu", *argv])
    with tempfile.TemporaryDirectory(prefix="onegpu-launch-") as folder:
        os.environ[LAUNCH_DIR_ENV] = folder
        print(f"train: launching {_launching(num_processes, machines)} (torch.distributed.run)", flush=True)
        try:
            with _without_elastic_repeats():
                torchrun.run(args)
        except ChildFailedError as e:
            noted = _first_noted_failure(Path(folder))
            if noted is None and all(f.exitcode in STOP_EXIT_CODES for f in e.failures.values()):
                # Every process stopped on a signal after its checkpoint (rank 0 ended the run KILLED).
                raise KeyboardInterrupt("every training process stopped on a signal") from None
            if noted is None and all(f.exitcode == 2 for f in e.failures.values()):
                # Bad input found before any work, said in one line by the processes (onegpu.cli).
                raise AlreadySaid("the training processes stopped on bad input before any work") from None
            failed, exitcode, what = _cause(e.failures, noted)
            share = num_processes // machines.num_machines
            where = f" (machine {failed // share})" if machines.num_machines > 1 else ""
            message = (f"training process rank {failed} of {num_processes}{where} {_elsewhere(what, machines)}; the "
                       "other processes were stopped")
            _fail_run(Path(folder), failed, exitcode, message)
            raise RankFailed(message) from None
        except Exception as e:
            signalled = _signal_in(e)
            if signalled is None:
                raise
            # torchrun forwarded it to the processes, which checkpoint and stop
            stopped = KeyboardInterrupt(f"the launch was stopped by {signalled.sigval.name} (what its processes kept: "
                                        "above)")
            stopped.signum = int(signalled.sigval)  # the stage exits 128 + it (onegpu.cli)
            raise stopped from None
        finally:
            os.environ.pop(LAUNCH_DIR_ENV, None)


def _signal_in(error: BaseException):
    """The ``SignalException`` (torch elastic's: a stop signal reached the launcher) that ``error`` is or was raised
    while handling; None if none. torch elastic's metrics wrapper (``elastic.metrics.api.prof``, torch 2.13) reads
    its start time in a ``finally``: a signal that lands before that time is set turns into ``UnboundLocalError``
    there, with the ``SignalException`` as its context; the processes were stopped all the same."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, SignalException):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


# torch elastic's log lines that onegpu's own line says again, by logger: a process failed (the rank, its error and
# machine: RankFailed), the others are stopped, a signal stops them all (the stop's line names it).
ELASTIC_REPEATS = {"torch.distributed.elastic.multiprocessing.api": ("failed (exitcode", "Sending process"),
                   "torch.distributed.elastic.agent.server.api": ("Received %s death signal",)}


class _Repeats(logging.Filter):
    """Drops the records whose message (the format string, before its arguments) starts with ``prefixes``."""

    def __init__(self, prefixes: tuple[str, ...]) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


@contextlib.contextmanager
def _without_elastic_repeats():
    """While a launch runs: :data:`ELASTIC_REPEATS` left out of the terminal (every other elastic line stays)."""
    added = [(logging.getLogger(name), _Repeats(prefixes)) for name, prefixes in ELASTIC_REPEATS.items()]
    for logger, repeats in added:
        logger.addFilter(repeats)
    try:
        yield
    finally:
        for logger, repeats in added:
            logger.removeFilter(repeats)


def _launching(num_processes: int, machines: Machines) -> str:
    """What this launcher starts, for its first line."""
    if machines.num_machines == 1:
        return f"{num_processes} processes"
    share = num_processes // machines.num_machines
    first = machines.machine_rank * share
    writes = ("this machine's rank 0 writes models/, the metrics and the MLflow run" if machines.machine_rank == 0
              else "machine 0 writes models/, the metrics and the MLflow run; nothing is written here")
    return (f"{share} of {num_processes} processes (ranks {first}..{first + share - 1}) on machine "
            f"{machines.machine_rank} of {machines.num_machines}, meeting at {machines.main_process_ip}; {writes}")


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


def _elsewhere(what: str, machines: Machines) -> str:
    """``what`` happened to this machine's failed process, said as a lost connection to another machine when it is
    one (:data:`LOST_PEER_SIGNS`) over several machines: the process that ended the run is there, and its machine's
    launcher names it (one killed outright notes nothing that reaches this one); else ``what``."""
    if machines.num_machines == 1 or not any(sign in what for sign in LOST_PEER_SIGNS):
        return what
    return (f"lost its connection to a process on another machine ({what.removeprefix('failed (')[:-1]}): that "
            "machine's launcher names the process and why")


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
    error) for :func:`launch`, which names the rank whose error came first, then re-raised.

    Over several machines (torchrun's ``LOCAL_WORLD_SIZE`` below ``WORLD_SIZE``) the note also goes to the
    rendezvous store on machine 0 (:func:`_store`), and rank 0, failing, first copies the other ranks' notes
    there into its folder (waiting up to :data:`NOTE_WAIT_S`): machine 0's launcher then names the first.

    A process whose collective failed because a peer is gone (:func:`lost_peer`) says so in one line and exits 1
    (``SystemExit``) instead of printing its traceback: the peer's own error (its traceback, or the signal that
    killed it) is what the launcher names."""
    import time
    try:
        yield
    except BaseException as e:
        folder = os.environ.get(LAUNCH_DIR_ENV)
        if folder and launched() and not isinstance(e, KeyboardInterrupt):
            error = f"{type(e).__name__}: {str(e)[:2000]}"
            note = json.dumps({"rank": rank(), "time": time.time(), "error": error})
            with contextlib.suppress(OSError):
                Path(folder, f"failed-{rank()}.json").write_text(note)
            if int(os.environ.get("LOCAL_WORLD_SIZE", world_size())) < world_size():
                _share_notes(Path(folder), note)
            if lost_peer(e):
                print(f"train: rank {rank()} stopped: a peer process is gone ({error.splitlines()[0][:300]}); "
                      "the launcher names which", file=sys.stderr, flush=True)
                raise SystemExit(1) from None
        raise


def peer_failed() -> bool:
    """Whether another process of this launch noted a failure (:func:`failure_note`) in this machine's launch
    folder: the launcher then stops the others with SIGTERM."""
    folder = os.environ.get(LAUNCH_DIR_ENV)
    own = f"failed-{rank()}.json"
    return bool(folder) and launched() and any(f.name != own for f in Path(folder).glob("failed-*.json"))


# What a collective raises when a peer process is gone: gloo's lost TCP pair; NCCL's aborted communicator.
LOST_PEER = ("Connection closed by peer", "Connection reset by peer", "remote process exited",
             "communicator was aborted")


def lost_peer(e: BaseException) -> bool:
    """Whether ``e`` is a collective's error on a peer process that is gone (:data:`LOST_PEER`, in a RuntimeError,
    which torch.distributed's errors are), not an error of this process's own."""
    return isinstance(e, RuntimeError) and any(s in str(e) for s in LOST_PEER)


def _store(timeout_s: float = 10):
    """A client of the launch's rendezvous store (torchrun's ``MASTER_ADDR``/``MASTER_PORT``, on machine 0);
    its gets and waits give up after ``timeout_s`` seconds."""
    from datetime import timedelta

    import torch.distributed as dist
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


def _share_notes(folder: Path, note: str) -> None:
    """This rank's ``note`` into the store; on rank 0, the other ranks' notes from it into ``folder``
    (any error of the store's is left out: the local notes still name a rank)."""
    import time
    try:
        store = _store()
        store.set(NOTE_KEY.format(rank=rank()), note)
        if not is_main():
            return
        others = [NOTE_KEY.format(rank=r) for r in range(1, world_size())]
        deadline = time.monotonic() + NOTE_WAIT_S
        while not (found := [k for k in others if store.check([k])]) and time.monotonic() < deadline:
            time.sleep(0.1)
        for key in found:
            Path(folder, f"failed-{key.rsplit('/', 1)[1]}.json").write_bytes(store.get(key))
    except Exception as e:  # the store went with a machine: say so, keep the local notes
        print(f"train: rank {rank()} could not share its failure note: {e}", file=sys.stderr)


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
