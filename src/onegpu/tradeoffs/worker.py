"""One worker process of ``onegpu tradeoffs``' probe rows (:mod:`onegpu.tradeoffs.pool` starts it).

It trains the rows it is sent one at a time, in the project root, into the project's MLflow store, as the
train stage would (:func:`onegpu.training.tracked_run.run`: the same run, tags, per-step series and figure),
with four differences: the prepared data is made in memory once per worker for each distinct set of the
params prepare reads (:func:`onegpu.data.pipeline.prepare`, the same function the prepare stage writes
to disk), nothing is written to ``models/``, ``metrics/`` or ``plots/``, no resumable checkpoint is
taken (a probe is re-run, not resumed; the checkpoints of the user's own runs are left alone), and the
run gets no figure of its own (the batch's report plots the rows).

Between rows it resets what a previous row could leave in the process and would change the next row's
training or speed: Accelerate's process-wide state, Python garbage, the CUDA allocator's cache. It keeps
what TorchDynamo compiled: a warm-up (``torch.compile``'s graphs, torchao's compiled optimizer step) is paid
once per worker, by the first row that needs it, and a later window of that row runs the same compiled code
(a new model of the same shapes passes its guards) instead of compiling it again. Any step that compiles
is left out of the row's samples/s either way (``step_compile_s``, :func:`onegpu.training.record.recorder.warm_up`),
and the batch's report says the seconds apart. Code no later row calls costs nothing but memory. What cannot
be reset, the host allocator (``train.cpu_allocator``: glibc's ``mallopt`` is process-wide and cannot be
undone), is why the pool keeps one worker per setting.
"""
from __future__ import annotations

import dataclasses
import gc
import json
import time

# The params prepare reads (dvc.yaml's prepare stage: params data, model.name_or_path, model.task,
# model.vocab_size): rows that agree on them share one prepared copy of the data.
PREPARE_PARAMS = ("data", "model.name_or_path", "model.task", "model.vocab_size")


def prepare_key(cfg) -> str:
    """The values of :data:`PREPARE_PARAMS` in ``cfg``, as one string."""
    d = cfg.to_dict()
    return json.dumps([d["data"], d["model"]["name_or_path"], d["model"]["task"], d["model"]["vocab_size"]],
                      sort_keys=True, default=str)


def prepared(cfg, cache: dict):
    """``(dsd, tokenizer, stats)`` for ``cfg``'s data: from ``cache`` (by :func:`prepare_key`) or made
    now (read, de-duplicate, split, tokenize: the prepare stage's work, in memory).

    Raises:
        onegpu.errors.DataError: the data cannot be read or prepared (as the prepare stage says).
    """
    key = prepare_key(cfg)
    if key not in cache:
        from datasets.utils.logging import disable_progress_bar

        from onegpu import data
        from onegpu.data import pipeline
        disable_progress_bar()
        fmt = data.check_input(cfg)
        dsd, tokenizer, stats, _ = pipeline.prepare(cfg, fmt, pipeline.tokenizer_maker(cfg))
        cache[key] = (dsd, tokenizer, stats)
    return cache[key]


def _reset_process_state() -> None:
    """What a previous row may leave behind: Accelerate's process-wide state (its ``Accelerator`` refuses
    another mixed precision once the state exists; transformers' TrainingArguments resets it the same way),
    garbage, cached CUDA blocks. Compiled code stays (the module docstring says why)."""
    from accelerate.state import AcceleratorState, GradientState

    from onegpu.measure import memory
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    gc.collect()
    memory.empty_cache()


def train_row(spec: dict, cache: dict) -> None:
    """Train one row: ``spec`` holds ``name`` (the MLflow run name), ``params`` (the params file) and
    ``overrides`` (``key=value`` strings, the probe window's first).

    Raises:
        onegpu.errors.UserError: the row's params or data are refused (before its MLflow run opens).
        Exception: its training failed (its MLflow run ended FAILED); KeyboardInterrupt: stopped (KILLED).
    """
    from onegpu import tracking
    from onegpu.config import load
    from onegpu.training import session, tracked_run
    cfg = load(spec["params"], spec["overrides"])
    dsd, tokenizer, stats = prepared(cfg, cache)
    plan = dataclasses.replace(session.plan(cfg, stats), resume=None)
    _reset_process_state()
    tracker = tracking.connect(cfg.tracking.experiment_name)
    tracked_run.run(plan, tracker, dsd, name=spec["name"], probe=True, tokenizer=tokenizer)


def get_ready(spec: dict, cache: dict) -> None:
    """Before any row: import what training imports and prepare the data of ``spec``'s params and
    ``overrides`` into ``cache``, so that the pool can start all its workers at once and no row's wall time
    holds its worker's start (:meth:`onegpu.tradeoffs.pool.Pool.ready`).

    Raises:
        onegpu.errors.UserError: the params or data are refused (the row then says so itself).
    """
    import peft  # noqa: F401  (the first row's imports, paid here: peft, transformers' Trainer, MLflow's store)

    from onegpu import tracking
    from onegpu.config import load
    from onegpu.training import tracked_run  # noqa: F401
    from onegpu.training.backends import hf_trainer  # noqa: F401
    cfg = load(spec["params"], spec["overrides"])
    prepared(cfg, cache)
    tracking.connect(cfg.tracking.experiment_name)


def main(conn, offline: bool) -> None:
    """The worker's loop: receive a row spec on ``conn`` (None: stop), train it (``"prepare"`` in it: only
    :func:`get_ready`), send back ``{"name", "returncode", "seconds"}`` (returncode 0 trained or ready, 2
    refused, 1 failed, None stopped by Ctrl-C or SIGINT, after which the worker ends). ``offline``: the
    model is local (no hub lookups, as the CLI). The interpreter is tuned as the ``onegpu`` command's
    (:mod:`onegpu.interpreter`)."""
    from onegpu import interpreter
    interpreter.start()
    if offline:
        from onegpu.models import loader
        loader.go_offline()  # before transformers and datasets are imported
    from onegpu.errors import UserError
    cache: dict = {}
    while True:
        try:
            spec = conn.recv()
        except (EOFError, KeyboardInterrupt):
            return
        if spec is None:
            return
        t0, rc = time.monotonic(), 0
        try:
            (get_ready if spec.get("prepare") else train_row)(spec, cache)
        except KeyboardInterrupt:
            conn.send({"name": spec["name"], "returncode": None, "seconds": time.monotonic() - t0})
            return
        except UserError as e:
            if not spec.get("prepare"):  # a refused prepare is said by the row that needs it
                print(f"onegpu tradeoffs: {spec['name']}: error: {e}", flush=True)
            rc = 2
        except Exception as e:  # its MLflow run says FAILED; the other rows still run
            print(f"onegpu tradeoffs: {spec['name']} failed: {type(e).__name__}: {e}", flush=True)
            rc = 1
        conn.send({"name": spec["name"], "returncode": rc, "seconds": time.monotonic() - t0})
