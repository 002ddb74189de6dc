"""The interpreter of an ``onegpu`` command process: its garbage collector (tuned while the command starts
and exits, CPython's own settings while it trains), its standard streams (a reader that went away is no
error: :class:`Tolerant`) and its stop signals (SIGTERM and SIGHUP raise KeyboardInterrupt as Ctrl-C's
SIGINT does: :func:`stop_on_signals`).

A command imports torch, transformers, datasets and MLflow: millions of objects, each import adding to
the heap. With CPython's default thresholds (``gc.get_threshold()``: a young-generation collection every
700 new container objects, the older generations every 10 of the younger ones) the collector traverses
that growing heap again and again while nothing of it is garbage, and once more at exit. A higher young
threshold while the command starts, and ``gc.freeze()`` (the objects alive move to a permanent
generation no collection scans: https://docs.python.org/3/library/gc.html#gc.freeze) once the imports
are done and again at exit, remove that work; the figures are in bench/results/interpreter.md
(``python -m bench.interpreter``).

The training and evaluation loops run with CPython's default thresholds (:func:`settle`, called by
``training.session.train`` and ``evaluation.metrics``), so the steps that onegpu measures collect garbage
as any PyTorch process does; only the frozen start-up objects are no longer scanned. A process that imports
onegpu as a library (a notebook, the tests, bench/) keeps its interpreter as it is: only :func:`start` (the
``onegpu`` command, a tradeoffs worker) changes anything.
"""
from __future__ import annotations

import atexit
import contextlib
import gc
import os
import signal
import sys

from onegpu import imports

DEFAULT_THRESHOLD = gc.get_threshold()  # CPython's, as this interpreter started
# The young generation's threshold while the command imports; the older generations' stay CPython's.
START_THRESHOLD = (10_000, *DEFAULT_THRESHOLD[1:])
_starting = False  # start() ran and settle() has not yet


def start() -> None:
    """For a command's start: stdout and stderr made :class:`Tolerant`, SIGTERM and SIGHUP handled
    (:func:`stop_on_signals`), transformers' unused optional imports skipped
    (:func:`onegpu.imports.skip_unused_optionals`), the higher young threshold until
    :func:`settle`, and ``gc.freeze()`` at exit (before the interpreter's final collections; atexit runs
    it after the handlers registered later)."""
    global _starting
    _starting = True
    tolerate_lost_streams()
    stop_on_signals()
    quiet_optional_kernels()
    imports.skip_unused_optionals()
    gc.set_threshold(*START_THRESHOLD)
    atexit.register(gc.freeze)


# Loggers of import-time lines about kernels onegpu never calls: torchao (imported by transformers
# whenever it is installed, for train.optim adamw_torch_8bit/4bit) says "Failed to load ..._C_mxfp8...so"
# for its prebuilt CUDA/other-Python extensions, and its enum registrations make torch's pytree log a
# deprecation per enum. Warnings only: their errors still show.
QUIET_LOGGERS = ("torchao", "torch.utils._pytree")


# torch's warning when it compiles torchao's optimizer step (a tensor subclass without a cache hash):
# about torch's compile cache, not the training.
QUIET_WARNINGS = (r".* does not implement _stable_hash_for_caching",)


def quiet_optional_kernels() -> None:
    """Only errors from :data:`QUIET_LOGGERS` (four lines in every stage otherwise, none about the work),
    and none of :data:`QUIET_WARNINGS` (two more in the first step of a torchao optimizer)."""
    import logging
    import warnings
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    for message in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=UserWarning)


def settle() -> None:
    """Before the measured work: freeze what is alive (libraries, model, data) and put CPython's default
    thresholds back. Once per process after :func:`start` (a later call, or one without it, does nothing:
    frozen objects are never collected, so freezing again would keep the garbage of earlier work)."""
    global _starting
    if _starting:
        _starting = False
        gc.freeze()
        gc.set_threshold(*DEFAULT_THRESHOLD)


class Tolerant:
    """A text stream (stdout or stderr) whose writes never raise: progress lines are for people, MLflow
    and the stage's files are the record, so a reader that went away must not fail a training.

    The first write or flush that fails (``OSError``: EPIPE when the pipe's reader exited, e.g. a
    ``make`` output filter stopped by Ctrl-C; EIO once the terminal hung up; ENOSPC for a full log disk;
    ``ValueError`` for a closed stream) points the stream's file descriptor at ``os.devnull`` and drops
    that text and everything after it (``lost`` holds the error). Everything else is the wrapped stream's.
    """

    def __init__(self, stream) -> None:
        self.stream = stream
        self.lost: BaseException | None = None

    def write(self, text: str) -> int:
        if self.lost is None:
            try:
                return self.stream.write(text)
            except (OSError, ValueError) as e:
                self._lose(e)
        return len(text)

    def flush(self) -> None:
        if self.lost is None:
            try:
                self.stream.flush()
            except (OSError, ValueError) as e:
                self._lose(e)

    def _lose(self, error: BaseException) -> None:
        self.lost = error
        with contextlib.suppress(OSError, ValueError):  # the interpreter's last flush then writes nowhere
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, self.stream.fileno())
            os.close(null)

    def __getattr__(self, name):  # fileno, isatty, encoding, buffer, ...
        return getattr(self.stream, name)


def tolerate_lost_streams() -> None:
    """``sys.stdout`` and ``sys.stderr`` as :class:`Tolerant` streams (once; None, as under ``pythonw``,
    stays None)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, Tolerant):
            setattr(sys, name, Tolerant(stream))


def _raise_interrupt(signum, frame):
    e = KeyboardInterrupt()
    e.signum = signum  # the command exits 128 + it
    raise e


def stop_on_signals() -> None:
    """SIGTERM (``kill``, a scheduler) and SIGHUP (the terminal closed) raise KeyboardInterrupt carrying
    ``signum``, as Ctrl-C's SIGINT does, so every stage ends its MLflow run KILLED with what it measured
    (the default action ends the process at once, its run left RUNNING). A training handles all three
    itself (:mod:`onegpu.training.interrupt`). A signal ignored when the command started stays ignored
    (``nohup``'s SIGHUP)."""
    for s in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(s) == signal.SIG_DFL:
            signal.signal(s, _raise_interrupt)
