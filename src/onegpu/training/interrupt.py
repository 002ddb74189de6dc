"""Stopping a training run cleanly on Ctrl-C (SIGINT) or SIGTERM.

The first signal asks the backend to stop after the optimizer step in progress and save a resumable
checkpoint; a second one abandons the step at once (plain KeyboardInterrupt). Either way the stage
ends the MLflow run as KILLED and exits non-zero (128 + the signal number).
"""
from __future__ import annotations

import signal
import sys
import threading


class Interrupted(KeyboardInterrupt):
    """Training stopped on a signal after saving a checkpoint. ``signum``: the signal number."""

    def __init__(self, signum: int, step: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name} after optimizer step {step}")
        self.signum, self.step = signum, step


class GracefulStop:
    """Context manager: while active, SIGINT/SIGTERM set ``requested`` (the signal number) instead of
    raising; a second signal raises KeyboardInterrupt. Handlers are restored on exit. Only the main
    thread can install handlers; elsewhere it does nothing."""

    def __init__(self) -> None:
        self.requested: int | None = None
        self._old: dict = {}

    def _handle(self, signum, frame) -> None:
        if self.requested is not None:
            raise KeyboardInterrupt
        self.requested = signum
        print(f"\n{signal.Signals(signum).name}: stopping after this optimizer step and saving a checkpoint "
              "(send it again to abandon the step)", file=sys.stderr, flush=True)

    def __enter__(self) -> "GracefulStop":
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self._old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old.clear()
