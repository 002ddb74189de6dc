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

A command also leaves out what transformers would import for no onegpu work (:func:`skip_unused_optionals`).
transformers decides at import time whether an optional package is installed, and a module whose code may use
it imports it then, used or not. Two of these cost a stage process most of its start (docs/details.md, "A stage
process's start"): ``transformers.quantizers`` imports torchao (a second of CPU with its ``torch._dynamo``
registrations) for loading torchao-quantized checkpoints, and the detection losses of
``transformers.loss.loss_utils`` import ``scipy.optimize`` (the Hungarian matcher of DETR-like models). onegpu
loads no quantized checkpoint and trains no detection model; torchao's low-bit AdamW (``train.optim:
adamw_torch_8bit`` / ``adamw_torch_4bit``) asks for torchao when its optimizer is built, and then gets it
(:func:`allow`). How: an import hook (:class:`_Patch`) wraps ``transformers.utils.import_utils``' availability
checks of :data:`SKIPPED` as soon as that module is imported, and before any module binds them, so that they
answer False until :func:`allow` names the package.
"""
from __future__ import annotations

import atexit
import contextlib
import gc
import importlib.abc
import importlib.machinery
import os
import signal
import sys

DEFAULT_THRESHOLD = gc.get_threshold()  # CPython's, as this interpreter started
# The young generation's threshold while the command imports; the older generations' stay CPython's.
START_THRESHOLD = (10_000, *DEFAULT_THRESHOLD[1:])
_starting = False  # start() ran and settle() has not yet


def start() -> None:
    """For a command's start: stdout and stderr made :class:`Tolerant`, SIGTERM and SIGHUP handled
    (:func:`stop_on_signals`), transformers' unused optional imports skipped
    (:func:`skip_unused_optionals`), the higher young threshold until
    :func:`settle`, and ``gc.freeze()`` at exit (before the interpreter's final collections; atexit runs
    it after the handlers registered later)."""
    global _starting
    _starting = True
    tolerate_lost_streams()
    stop_on_signals()
    quiet_optional_kernels()
    skip_unused_optionals()
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
    itself (:mod:`onegpu.training.lifecycle.interrupt`). A signal ignored when the command started stays ignored
    (``nohup``'s SIGHUP)."""
    for s in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(s) == signal.SIG_DFL:
            signal.signal(s, _raise_interrupt)


# transformers.utils.import_utils' check -> the package it checks.
SKIPPED = {"is_torchao_available": "torchao", "is_scipy_available": "scipy"}
TARGET = "transformers.utils.import_utils"
_allowed: set[str] = set()


def allow(package: str) -> None:
    """From now on this process's transformers sees ``package`` (a value of :data:`SKIPPED`) as installed
    if it is: call before the code that needs it (torchao's optimizer, say) runs."""
    _allowed.add(package)


def _gated(check, package: str):
    def gated(*args, **kwargs):
        return package in _allowed and check(*args, **kwargs)
    gated.__name__ = gated.__qualname__ = check.__name__
    gated.__doc__ = (check.__doc__ or "") + f"\n\n(onegpu: False unless onegpu.interpreter.allow({package!r}).)"
    return gated


def _patch(module) -> None:
    for name, package in SKIPPED.items():
        check = getattr(module, name, None)
        if check is not None and not getattr(check, "_onegpu_gated", False):
            gated = _gated(check, package)
            gated._onegpu_gated = True
            setattr(module, name, gated)


class _Patch(importlib.abc.MetaPathFinder):
    """A finder for :data:`TARGET` alone: the module is found by the regular machinery and its loader
    wrapped (:class:`_PatchingLoader`)."""

    def find_spec(self, fullname, path, target=None):
        if fullname != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _PatchingLoader(spec.loader)
        return spec


class _PatchingLoader(importlib.abc.Loader):
    """``loader``'s module, then :func:`_patch` on it before the importer (``transformers.utils``) binds
    its names."""

    def __init__(self, loader) -> None:
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        _patch(module)


def skip_unused_optionals() -> None:
    """Install the hook (once; where transformers is already imported, patch its checks in place: modules
    that bound them already keep the originals)."""
    if TARGET in sys.modules:
        _patch(sys.modules[TARGET])
    elif not any(isinstance(f, _Patch) for f in sys.meta_path):
        sys.meta_path.insert(0, _Patch())
