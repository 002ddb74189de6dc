"""A benchmark's arms: the bench setup's config, data and models, and their training runs.

Each script builds a small but real setup in its own process: the packaged BBC News corpus read,
de-duplicated, split and tokenized by :mod:`onegpu.data` with the packaged MiniLM tokenizer, a
``Config`` validated by :func:`onegpu.config.from_container`, and the real training code, driven
as the train stage drives it
(:func:`~onegpu.training.tracked_run.run` for a tracked run, :func:`~onegpu.training.session.fit` for the
training alone), in the process :func:`bench.environment.setup` isolated.

Timing conventions used by every script:
- ``step_time_s`` comes from :class:`onegpu.training.record.recorder.StepRecorder` (wall time from the end of
  one optimizer step to the end of the next, data loading included, CUDA-synchronised);
- optimizer step 1 is warm-up and is excluded from step-time medians and steady-state throughput;
- repetitions are summarised by their median.
"""
from __future__ import annotations

import contextlib
import gc
import io
import statistics
import time
from collections.abc import Callable, Iterable

from bench.machine import clean_run
from bench.reporting import median
from onegpu.formatting import mib


def make_cfg(args, *, micro: int, accum: int, steps: int | None = None, checkpointing: bool = False,
             overrides: tuple[str, ...] = (), **train) -> object:
    """A validated Config (``config.from_container``) for the bench setup; ``overrides`` are
    ``section.key=value`` items applied last, as ``dvc exp run -S`` applies them."""
    from onegpu import config
    raw = {
        "data": {"max_length": args.max_length, "max_train_samples": args.rows, "max_eval_samples": 10,
                 "seed": args.seed},
        "train": {"per_device_train_batch_size": micro, "gradient_accumulation_steps": accum,
                  "max_steps": steps or args.steps, "gradient_checkpointing": checkpointing,
                  "bf16": bool(args.bf16), "seed": args.seed, "logging_steps": 10**6, **train},
        "tracking": {"experiment_name": "bench"},
    }
    # An out-of-memory error is a result here ("OOM"), not something to recover from by re-splitting.
    raw["train"].setdefault("oom_retry", False)
    for item in overrides:
        config.apply_override(raw, item)
    return config.from_container(raw, source="bench")


_DATA: dict = {}


def data(cfg):
    """``(DatasetDict, labels, tokenizer, model_path)``: packaged BBC data tokenized as prepare does it.

    Cached per (max_length, rows, seed) within the process.
    """
    from onegpu.data import formats, pipeline
    from onegpu.models import loader
    key = (cfg.data.max_length, cfg.data.max_train_samples, cfg.data.seed)
    if key not in _DATA:
        path = loader.resolve_model_path(cfg.model.name_or_path)
        tokenizer = loader.load_tokenizer(path, cfg.model.task)
        dsd, _, _, _ = pipeline.prepare(cfg, formats.TEXT, lambda texts: tokenizer)
        _DATA[key] = (dsd, dsd["train"].features["label"].names, tokenizer, path)
    return _DATA[key]


def pretrained_model(cfg, labels, path):
    """The packaged MiniLM with a fresh classification head, seeded as the train stage seeds it."""
    from transformers import set_seed

    from onegpu.models import loader
    set_seed(cfg.train.seed)
    return loader.build_classifier(path, labels, cfg.model.dropout, cfg.model.attn_implementation)


def bert_from_config(cfg, labels, path, layers: int, hidden: int | None = None, heads: int | None = None):
    """A randomly initialised BERT classifier from the MiniLM config with other sizes (speed/memory only).

    ``hidden`` None keeps MiniLM's 384; heads default to hidden/64; the MLP is 4 x hidden.
    """
    from transformers import AutoConfig, AutoModelForSequenceClassification, set_seed
    kw = {"num_hidden_layers": layers}
    if hidden:
        kw.update(hidden_size=hidden, num_attention_heads=heads or max(1, hidden // 64),
                  intermediate_size=4 * hidden)
    conf = AutoConfig.from_pretrained(path, num_labels=len(labels), id2label=dict(enumerate(labels)),
                                      label2id={lab: i for i, lab in enumerate(labels)}, **kw)
    set_seed(cfg.train.seed)
    return AutoModelForSequenceClassification.from_config(conf)


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def describe_model(model) -> str:
    c = model.config
    return f"BERT {c.num_hidden_layers}L h{c.hidden_size} ({n_params(model) / 1e6:.1f} M params)"


def noop_sink(metrics: dict, step: int) -> None:
    return None


@contextlib.contextmanager
def quiet(verbose: bool = False):
    """Swallow the Trainer's stdout (its per-log prints), unless verbose."""
    if verbose:
        yield
        return
    with contextlib.redirect_stdout(io.StringIO()):
        yield


def release_memory() -> None:
    """Free what earlier runs left: Python garbage, the CUDA cache, and glibc's retained heap."""
    gc.collect()
    try:
        import torch
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    except ImportError:
        pass
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def is_oom(e: BaseException) -> bool:
    import torch
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def _plan(cfg, dsd):
    """The session's plan for ``cfg`` on the bench data (fingerprint ``"bench"``)."""
    from onegpu.training import session
    return session.plan(cfg, {"fingerprint": "bench", "labels": dsd["train"].features["label"].names})


def _result(rec, wall: float) -> dict:
    out = steady(rec.rows)
    out.update(wall_s=wall, summary=rec.summary(), memory=rec.memory(),
               rows=[dict(r) for r in rec.rows], oom_events=list(rec.events))
    return out


def train_once(model, tokenizer, dsd, cfg, sink=noop_sink, verbose: bool = False, stage_like: bool = False,
               release: bool = True) -> dict:
    """One training run (:func:`onegpu.training.session.fit`, the configured backend); the per-step rows
    and their steady-state summary (steps 2..N).

    ``stage_like``: as the train stage trains (Ctrl-C handling and a checkpoint folder, written only on a
    stop with ``train.save_steps`` null). ``release``: free memory (:func:`release_memory`) first,
    outside the timing.
    """
    from onegpu.training import session
    plan = _plan(cfg, dsd)
    if release:
        release_memory()
    t0 = time.perf_counter()
    with quiet(verbose):
        _, rec = session.fit(plan, model, tokenizer, dsd, sink, run_id="bench", checkpoints=stage_like)
    return _result(rec, time.perf_counter() - t0)


def stage_run(tracker, model, tok, dsd, cfg, verbose: bool = False) -> dict:
    """The train stage's run, :func:`onegpu.training.tracked_run.run`, into ``tracker``'s store with the given
    model (saving outputs is left out): start_run with the stage's tags, params, model tags, the batched
    writer as the per-step sink, MLflow's system-metrics monitor around training, flush, summary metrics.
    ``total_s`` = the whole of it; ``outside_loop_s`` = the part outside the backend's training loop."""
    from onegpu.training import tracked_run
    plan = _plan(cfg, dsd)
    release_memory()  # the harness's own clean-up, before the clock starts
    t0 = time.perf_counter()
    with quiet(verbose):
        result = tracked_run.run(plan, tracker, dsd, built=(model, tok))
    total = time.perf_counter() - t0
    res = _result(result.steps, result.train_s)
    logged = len(tracker.client.get_metric_history(result.run_id, "loss"))
    res.update(outside_loop_s=total - result.train_s, total_s=total, loss_points_in_store=logged,
               system_metrics=True, run_id=result.run_id)
    return res


def train_or_oom(build: Callable[[], object], tokenizer, dsd, cfg, verbose: bool = False) -> dict:
    """:func:`train_once` on the model ``build()`` makes; ``{"oom": True}`` when it runs out of memory
    (a result here: the split or setting does not fit)."""
    import torch
    try:
        return train_once(build(), tokenizer, dsd, cfg, verbose=verbose)
    except (torch.OutOfMemoryError, RuntimeError) as e:
        if not is_oom(e):
            raise
        release_memory()
        return {"oom": True}


def rotated(names: list, rep: int) -> list:
    """``names`` rotated by ``rep``: each arm leads once every ``len(names)`` repetitions (for two arms:
    the order alternates)."""
    k = rep % len(names)
    return list(names[k:]) + list(names[:k])


def run_reps(args, order: Callable[[int], Iterable], one: Callable[[object], dict],
             say: Callable[[dict], str] = lambda res: "done", clean: bool = True) -> dict:
    """The arms' runs, ``args.reps`` repetitions in the arms' ``order(rep)``: each ``one(arm)`` (in
    :func:`clean_run` unless ``clean`` is False; its result gets ``rep``), then one printed line
    ``rep N/R <arm>: <say(result)>``. Returns ``{arm: [result per repetition]}``."""
    runs: dict = {}
    for rep in range(args.reps):
        for arm in order(rep):
            res = clean_run(lambda arm=arm: one(arm), args, str(arm)) if clean else one(arm)
            res["rep"] = rep
            runs.setdefault(arm, []).append(res)
            print(f"rep {rep + 1}/{args.reps} {arm}: {say(res)}", flush=True)
    return runs


def training_line(res: dict) -> str:
    """One run's figures for the progress line: samples/s, median step, peak memory, activation bytes."""
    if res.get("oom"):
        return "out of memory"
    return (f"{res['samples_per_second']:.2f} samples/s, median step {res['median_step_s']:.3f} s, peak "
            f"{mib(res['summary'].get('train_mem_peak_bytes'))}, activations "
            f"{mib(res['memory'].get('mem_activation_bytes'))}")


def builder(cfg, labels, path, layers: int | None = None, hidden: int | None = None):
    """``(build(cfg) -> model, name)``: the packaged MiniLM-L6 (``layers`` None) or a BERT of ``layers``
    layers (and ``hidden`` width) from its config, random init; the name for the report."""
    def build(c):
        if layers is None:
            return pretrained_model(c, labels, path)
        return bert_from_config(c, labels, path, layers, hidden)
    kind = "MiniLM-L6 (pretrained), " if layers is None else "from config, random init, "
    return build, kind + describe_model(build(cfg))


def medians(results: list[dict]) -> dict:
    """An arm's repetitions summed up: ``oom`` (none fitted), the medians of samples/s, step time, peak
    memory and activation bytes over the runs that fitted, and those runs (``ok``)."""
    ok = [r for r in results if not r.get("oom")]
    return {"oom": not ok, "ok": ok,
            "samples_per_second": median(r["samples_per_second"] for r in ok),
            "median_step_s": median(r["median_step_s"] for r in ok),
            "train_mem_peak_bytes": median(r["summary"].get("train_mem_peak_bytes") for r in ok),
            "mem_activation_bytes": median(r["memory"].get("mem_activation_bytes") for r in ok)}


def without_rows(runs: dict) -> dict:
    """``{arm: [result, ...]}`` with each result's per-step ``rows`` left out (for the JSON payload)."""
    return {arm: [{k: v for k, v in r.items() if k != "rows"} for r in rs] for arm, rs in runs.items()}


def steady(rows: list[dict]) -> dict:
    """Median/mean step time over optimizer steps 2..N (step 1 is warm-up) and the steady-state
    samples/s (:func:`onegpu.training.record.recorder.steady_samples_per_second`, NaN without steps 2..N)."""
    from onegpu.training.record.recorder import steady_samples_per_second
    t = [r["step_time_s"] for r in rows if r["step"] >= 2]
    sps = steady_samples_per_second(rows)
    return {"step_times_s": [r["step_time_s"] for r in rows],
            "median_step_s": statistics.median(t) if t else float("nan"),
            "mean_step_s": statistics.fmean(t) if t else float("nan"),
            "samples_per_second": float("nan") if sps is None else sps,
            "steady_steps": len(t)}


def warm_up(args) -> None:
    """Two tiny optimizer steps, so the first measured run does not pay one-off start-up costs."""
    cfg = make_cfg(args, micro=2, accum=1, steps=2)
    dsd, labels, tok, path = data(cfg)
    train_once(pretrained_model(cfg, labels, path), tok, dsd, cfg, verbose=args.verbose)
