"""CPython's cyclic garbage collector for an ``onegpu`` command: tuned while it starts and exits, CPython's
own settings while it trains.

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
as any PyTorch process does; only the frozen start-up objects are no longer scanned. A process that imports onegpu as a library (a notebook, the tests, bench/) keeps its
interpreter as it is: only :func:`start` (the ``onegpu`` command, a tradeoffs worker) changes anything.
"""
from __future__ import annotations

import atexit
import gc

DEFAULT_THRESHOLD = gc.get_threshold()  # CPython's, as this interpreter started
# The young generation's threshold while the command imports; the older generations' stay CPython's.
START_THRESHOLD = (10_000, *DEFAULT_THRESHOLD[1:])
_starting = False  # start() ran and settle() has not yet


def start() -> None:
    """For a command's start: the higher young threshold until :func:`settle`, and ``gc.freeze()`` at
    exit (before the interpreter's final collections; atexit runs it after the handlers registered later)."""
    global _starting
    _starting = True
    gc.set_threshold(*START_THRESHOLD)
    atexit.register(gc.freeze)


def settle() -> None:
    """Before the measured work: freeze what is alive (libraries, model, data) and put CPython's default
    thresholds back. Once per process after :func:`start` (a later call, or one without it, does nothing:
    frozen objects are never collected, so freezing again would keep the garbage of earlier work)."""
    global _starting
    if _starting:
        _starting = False
        gc.freeze()
        gc.set_threshold(*DEFAULT_THRESHOLD)
