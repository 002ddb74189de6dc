"""Stopping a training run cleanly on a signal: Ctrl-C (SIGINT, which a terminal sends to its whole
foreground process group; ``dvc queue kill`` sends it to the experiment's group too), SIGTERM (``kill``,
a scheduler's preemption, torchrun stopping the other ranks when one failed) and SIGHUP (the terminal
closed, an ssh session dropped; left alone when the command started with it ignored, as under ``nohup``).

:class:`GracefulStop` is active for the whole training run, its closing record included:

- before the loop (building the model, the ``auto`` finder) a signal abandons the run at once: nothing
  is trained yet;
- in the loop (:meth:`GracefulStop.loop`) the first signal asks the backend to stop after the optimizer
  step in progress and save a resumable checkpoint (``requested``); a second SIGINT or SIGTERM abandons
  the step (the newest complete checkpoint stays), a second SIGHUP is the same closed terminal and only
  noted. Without checkpoints (a tradeoffs probe row) the first signal abandons the step;
- after the loop (the steps flushed to MLflow, the error tags, the figure, the outputs) signals are
  only noted (``noted``), so that nothing cuts the run's record short; SIGKILL still can (schedulers
  send it a grace period after SIGTERM, 30 s by default in SLURM and Kubernetes; docs/details.md).

The stage exits 128 + the signal number; :func:`describe` is its last line.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# Seconds a scheduler waits between SIGTERM and SIGKILL by default: SLURM's KillWait, Kubernetes'
# terminationGracePeriodSeconds (both 30).
SCHEDULER_GRACE_S = 30


class Interrupted(KeyboardInterrupt):
    """Training stopped on a signal after saving a checkpoint (under ``train.fsdp`` too: every process its
    shards). ``signum``: the signal number; ``step``: the optimizer steps done; the session adds ``run_id``,
    ``steps_logged`` and ``checkpoint`` (the checkpoint folder kept) for :func:`describe`."""

    def __init__(self, signum: int, step: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name} after optimizer step {step}")
        self.signum, self.step = signum, step
        self.run_id: str | None = None
        self.steps_logged: int | None = None
        self.checkpoint: str | None = None


def stopped_by(signum: int, what: str = "") -> KeyboardInterrupt:
    """A plain KeyboardInterrupt that carries ``signum`` (the stage's exit code is 128 + it) and says
    what it stopped (``what``, e.g. "the optimizer step in progress, abandoned")."""
    e = KeyboardInterrupt(f"{signal.Signals(signum).name} stopped {what}" if what else "")
    e.signum = signum
    return e


# The optimizer step whose validation pass is running (:func:`validating`), for the stop line; empty between.
VALIDATING: list[int] = []


@contextlib.contextmanager
def validating(step: int):
    """Mark a validation pass after optimizer ``step`` (:class:`onegpu.training.record.recorder.StepRecorder`), so
    a signal during it says that the run stops after the pass, with ``step``'s checkpoint (both backends
    check for a stop once the pass is over)."""
    VALIDATING.append(step)
    try:
        yield
    finally:
        VALIDATING.pop()


class GracefulStop:
    """A context manager (main thread only; elsewhere it does nothing) that handles SIGINT, SIGTERM and
    SIGHUP as the module docstring says and restores the previous handlers on exit.

    ``checkpoints``: the loop can stop at a step's end with a checkpoint (False: a signal in the loop
    abandons it); ``progress``: ``() -> (steps done, seconds per optimizer step or None, newest
    checkpoint's step or None)``, for the line a SIGTERM prints (a step longer than a scheduler's grace
    period is said plainly)."""

    def __init__(self, checkpoints: bool = True, progress: Callable[[], tuple] | None = None) -> None:
        self.checkpoints, self.progress = checkpoints, progress
        self.requested: int | None = None
        self.noted: list[int] = []
        self._phase = "before"
        self._old: dict = {}

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self._phase == "after" or (self.requested is not None and signum == signal.SIGHUP):
            # (a closed terminal sends SIGHUP twice: bash passes it to its jobs, the kernel to the foreground
            # group once bash exits; one event, not a second request)
            self.noted.append(signum)
            if self._phase == "after":
                from onegpu.training.parallel import distributed  # the standard library only
                whose = " (the launcher's: a peer process failed)" if distributed.peer_failed() else ""
                _say(f"{name}{whose}: the run's record is being written first (its steps, tags and figure); "
                     "it stops after that")
        elif self._phase == "loop" and self.checkpoints and self.requested is None:
            self.requested = signum
            _say(self._stop_line(name))
        elif self._phase == "loop":
            raise stopped_by(signum, "the optimizer step in progress, abandoned (no new checkpoint)")
        else:
            raise stopped_by(signum, "the run before its training began")

    def _stop_line(self, name: str) -> str:
        done, step_s, saved = self.progress() if self.progress else (None, None, None)
        if VALIDATING:  # between two steps: the pass ends, then the checkpoint of the step it follows
            where = f"the validation pass of optimizer step {VALIDATING[-1]}"
        else:
            where = f"optimizer step {done + 1}" if done is not None else "this optimizer step"
        line = (f"\n{name}: stopping after {where} and saving a checkpoint (send it again to abandon the "
                + ("pass)" if VALIDATING else "step)"))
        if name == "SIGTERM" and step_s is not None and step_s >= SCHEDULER_GRACE_S / 2:
            line += (f"; an optimizer step takes about {step_s:.0f} s here: with the checkpoint's save it may not "
                     f"fit a scheduler's usual {SCHEDULER_GRACE_S} s from SIGTERM to SIGKILL (SLURM KillWait, "
                     "Kubernetes terminationGracePeriodSeconds); if SIGKILL comes first, the newest complete "
                     "checkpoint is " + (f"that of step {saved}" if saved else
                                         "none (train.save_steps sets how often one is written)"))
        return line

    @contextlib.contextmanager
    def loop(self):
        """Around the backend's training loop: the phase in which a signal stops at a step's end."""
        self._phase = "loop"
        try:
            yield self
        finally:
            self._phase = "after"

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                if s != signal.SIGHUP or signal.getsignal(s) != signal.SIG_IGN:  # nohup's
                    self._old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old.clear()


def _say(text: str) -> None:
    """One line to stderr, by rank 0 of a launch (Ctrl-C reaches every process of the foreground group: one line,
    not one per process; every process stops after the same step); a terminal or pipe that is gone is no error
    here (the run is the record)."""
    if os.environ.get("RANK", "0") != "0":  # (onegpu.training.parallel.distributed.is_main, without its imports)
        return
    with contextlib.suppress(OSError, ValueError):
        print(text, file=sys.stderr, flush=True)


MAKE_TARGET = "ONEGPU_MAKE_TARGET"  # the Makefile's run, sft, dpo and grpo recipes set it to their target's name


def resume_command() -> str:
    """The command that resumes this stage's stopped training, as the user started it: ``make run`` /
    ``make sft`` / ``make dpo`` / ``make grpo`` (the recipe sets ``ONEGPU_MAKE_TARGET``; with make's
    ``MAKELEVEL`` alone a ``dvc repro`` is ``make run``'s), ``dvc repro``, the same ``dvc exp run`` (DVC sets
    ``DVC_EXP_NAME``; a queued or ``--temp`` one runs in ``<repo>/.dvc/tmp/exps/``), or ``onegpu train``."""
    target = os.environ.get(MAKE_TARGET)
    if os.environ.get("DVC_EXP_NAME"):
        if f"{os.sep}.dvc{os.sep}tmp{os.sep}exps{os.sep}" in os.getcwd() + os.sep:
            return ("queueing the same experiment again (`dvc exp run --queue` with the same -S params, "
                    "then `dvc queue start`)")
        return f"`make {target}` again (the same `dvc exp run`)" if target else "the same `dvc exp run`"
    if os.environ.get("DVC_STAGE"):
        target = target or ("run" if "MAKELEVEL" in os.environ else None)
        return f"`make {target}` again (`dvc repro`)" if target else "`dvc repro`"
    return "`onegpu train` again (or `dvc repro`)"


def describe(e: KeyboardInterrupt) -> str:
    """The stage's last line for a stop: what stopped it, what was kept and the command that resumes it."""
    signum = getattr(e, "signum", signal.SIGINT)
    name = signal.Signals(signum).name
    if not isinstance(e, Interrupted):
        return str(e) if str(e) else f"interrupted by {name}"
    kept = f"the checkpoint of optimizer step {e.step} ({e.checkpoint})" if e.checkpoint else "a checkpoint"
    if e.run_id:
        kept += f" and its {e.steps_logged} steps in MLflow run {e.run_id} (KILLED)"
    return f"stopped by {name} after optimizer step {e.step}; kept {kept}; {resume_command()} resumes it"
