"""Shared helpers for the bench/ scripts.

Each script builds a small but real setup in its own process: the packaged BBC News corpus read,
de-duplicated, split and tokenized by :mod:`onegpu.data` with the packaged MiniLM tokenizer, a
``Config`` validated by :func:`onegpu.config.from_container`, and the real training code, driven
as the train stage drives it (:func:`~onegpu.training.tracked_run.run` for a tracked run,
:func:`~onegpu.training.session.fit` for the training alone). Nothing is fetched from a hub, and the user's
MLflow store is never touched: :func:`setup` points ``DVC_ROOT`` at a temporary directory (so ``tracking.connect``
opens ``<tmp>/mlflow.db``), removes every ``MLFLOW_*`` variable, and deletes the directory at exit.

Timing conventions used by every script:
- ``step_time_s`` comes from :class:`onegpu.training.recorder.StepRecorder` (wall time from the end of
  one optimizer step to the end of the next, data loading included, CUDA-synchronised);
- optimizer step 1 is warm-up and is excluded from step-time medians and steady-state throughput;
- repetitions are summarised by their median.
"""
from __future__ import annotations

import argparse
import atexit
import contextlib
import datetime
import gc
import io
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from onegpu.formatting import mib

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
RESULTS = BENCH / "results"

_TMP: Path | None = None


# -- environment ------------------------------------------------------------------------------------

def setup() -> Path:
    """Isolate the process: offline hub, temporary project root and MLflow store, quiet progress bars.

    Must run before transformers/datasets are imported. Returns the temporary directory (removed at exit).
    """
    global _TMP
    if _TMP is not None:
        return _TMP
    from onegpu.models import loader
    loader.go_offline()
    for k in [k for k in os.environ if k.startswith(("MLFLOW_", "DVC_", "HF_MLFLOW_"))]:
        del os.environ[k]
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ["TQDM_DISABLE"] = "1"          # no progress bars (same for every arm)
    _TMP = Path(tempfile.mkdtemp(prefix="onegpu-bench-"))
    (_TMP / "tmp").mkdir()
    os.environ["DVC_ROOT"] = str(_TMP)        # tracking.connect -> sqlite:///<tmp>/mlflow.db
    tempfile.tempdir = str(_TMP / "tmp")      # the trainer backend's scratch output_dir lands here too
    atexit.register(shutil.rmtree, _TMP, ignore_errors=True)
    import signal
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # so atexit runs (timeout)
    import logging
    import warnings
    warnings.filterwarnings("ignore")
    logging.getLogger("mlflow").setLevel(logging.ERROR)
    logging.getLogger("alembic").setLevel(logging.ERROR)
    from datasets.utils.logging import disable_progress_bar
    disable_progress_bar()
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    return _TMP


def tmpdir() -> Path:
    assert _TMP is not None, "call common.setup() first"
    return _TMP


# -- command line -----------------------------------------------------------------------------------

def parser(description: str, *, reps: int, steps: int, max_length: int = 64, rows: int = 200,
           micro: int | None = None, accum: int | None = None) -> argparse.ArgumentParser:
    """The options every script has (each script adds its own)."""
    p = argparse.ArgumentParser(description=description,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--reps", type=int, default=reps, help="repetitions (medians are reported)")
    p.add_argument("--steps", type=int, default=steps, help="optimizer steps per run (step 1 is warm-up)")
    p.add_argument("--max-length", type=int, default=max_length, help="tokens per example (truncation)")
    p.add_argument("--rows", type=int, default=rows, help="training rows (data.max_train_samples)")
    if micro is not None:
        p.add_argument("--micro", type=int, default=micro, help="micro-batch (per_device_train_batch_size)")
    if accum is not None:
        p.add_argument("--accum", type=int, default=accum, help="gradient_accumulation_steps")
    p.add_argument("--bf16", action="store_true", help="bf16 mixed precision (train.bf16; use on GPU)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--tag", default="", help="suffix for the result files: results/<name>-<tag>.json")
    p.add_argument("--verbose", action="store_true", help="show the Trainer's own output")
    p.add_argument("--max-wait", type=float, default=120.0,
                   help="seconds to wait, before each run, for other processes to stop using the CPU")
    p.add_argument("--retries", type=int, default=2,
                   help="reruns of a run during which other processes used more than "
                        f"{CONTENTION_LIMIT} cores")
    return p


# -- data, config, models ---------------------------------------------------------------------------

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
    from onegpu import data as odata
    from onegpu.models import loader
    key = (cfg.data.max_length, cfg.data.max_train_samples, cfg.data.seed)
    if key not in _DATA:
        path = loader.resolve_model_path(cfg.model.name_or_path)
        tokenizer = loader.load_tokenizer(path, cfg.model.task)
        raw = odata.read(cfg.data, cfg.model.task)
        texts, labels, _ = odata.deduplicate(raw)
        dsd = odata.split(texts, labels, cfg.data, cfg.model.task)
        dsd = odata.tokenize(dsd, tokenizer, cfg.data.max_length, cfg.model.task)
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
                                      label2id={name: i for i, name in enumerate(labels)}, **kw)
    set_seed(cfg.train.seed)
    return AutoModelForSequenceClassification.from_config(conf)


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def describe_model(model) -> str:
    c = model.config
    return f"BERT {c.num_hidden_layers}L h{c.hidden_size} ({n_params(model) / 1e6:.1f} M params)"


# -- running ----------------------------------------------------------------------------------------

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
    samples/s (:func:`onegpu.training.recorder.steady_samples_per_second`, NaN without steps 2..N)."""
    from onegpu.training.recorder import steady_samples_per_second
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


# -- other load on the machine ----------------------------------------------------------------------
# A small shared machine runs other work (test suites, builds) now and then; a run that overlaps it is
# measured again. "Other load" = what the train stage tags as outside load (tag onegpu.outside_load): the
# whole machine's busy CPU time (psutil, steal included) less this process tree's, per second of wall
# time, in cores.

CONTENTION_LIMIT = 0.2


class OtherLoad:
    """``with OtherLoad() as load: ...`` then ``load.cores``: other processes' CPU use during the block
    (this process and its children are not "other"; :class:`onegpu.measure.outside_load.Watch`)."""

    def __enter__(self):
        from onegpu.measure import outside_load
        self._watch = outside_load.Watch()
        self._watch.start()
        return self

    def __exit__(self, *exc):
        figures = self._watch.stop()
        self.cores = figures["cpu_busy"] if figures else 0.0
        return False


def wait_quiet(max_wait: float, limit: float = CONTENTION_LIMIT) -> float:
    """Wait (up to ``max_wait`` s) until other processes use less than ``limit`` cores for 2 s in a row.

    Returns the seconds waited.
    """
    t0 = time.perf_counter()
    quiet_windows = 0
    while time.perf_counter() - t0 < max_wait:
        with OtherLoad() as load:
            time.sleep(1.0)
        quiet_windows = quiet_windows + 1 if load.cores < limit else 0
        if quiet_windows >= 2:
            break
    return time.perf_counter() - t0


def clean_run(fn, args, label: str = "") -> dict:
    """``fn()`` (which builds its model and trains, returning a result dict) on a quiet machine.

    Waits for quiet first; reruns (``args.retries`` times at most) when other processes used more than
    :data:`CONTENTION_LIMIT` cores during the run. The result gets ``other_load_cores``, ``attempts``
    and ``waited_s``.
    """
    waited, best = 0.0, None
    for attempt in range(1 + max(0, args.retries)):
        waited += wait_quiet(args.max_wait)
        with OtherLoad() as load:
            res = fn()
        res["other_load_cores"] = round(load.cores, 3)
        if best is None or res["other_load_cores"] < best["other_load_cores"]:
            best = res  # if every attempt overlapped other work, keep the least disturbed one
        if load.cores <= CONTENTION_LIMIT or attempt == max(0, args.retries):
            break
        print(f"  {label}: other processes used {load.cores:.2f} cores during the run; measuring again",
              flush=True)
    best.update(attempts=attempt + 1, waited_s=round(waited, 1))
    return best


def load_note(results: list[dict]) -> str:
    """One line on other load: how many runs were measured again and the worst load kept."""
    redone = sum(r.get("attempts", 1) - 1 for r in results)
    worst = max((r.get("other_load_cores", 0.0) for r in results), default=0.0)
    waited = sum(r.get("waited_s", 0.0) for r in results)
    s = (f"Other load on the machine: runs measured again because other processes used > "
         f"{CONTENTION_LIMIT} cores: {redone}; highest other load in a kept run: {worst:.2f} cores; "
         f"waited {waited:.0f} s for quiet.")
    if worst > CONTENTION_LIMIT:
        s += " Some kept runs overlapped other work: treat their numbers with care."
    return s


# -- statistics and output --------------------------------------------------------------------------

def median(xs) -> float:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else float("nan")


def _cpu_model() -> str:
    from onegpu.measure.flops import cpu_model
    return cpu_model() or platform.processor() or platform.machine()


def machine() -> dict:
    """What ran the benchmark: CPU model, cores, GPU, library versions, date."""
    import mlflow
    import torch
    import transformers

    from onegpu.measure import memory
    info = {"cpu": _cpu_model(), "arch": platform.machine(), "cores": memory.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "cuda": torch.version.cuda if torch.cuda.is_available() else None,
            "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "mlflow": mlflow.__version__,
            "date": datetime.date.today().isoformat()}
    try:
        with open("/proc/meminfo") as f:
            info["ram_gib"] = round(int(f.readline().split()[1]) / 2**20)
    except (OSError, ValueError, IndexError):
        pass
    return info


def machine_line(m: dict) -> str:
    dev = f"GPU {m['gpu']} (CUDA {m['cuda']})" if m.get("gpu") else "no GPU"
    ram = f", {m['ram_gib']} GiB RAM" if m.get("ram_gib") else ""
    return (f"Machine: {m['cpu']} ({m['arch']}), {m['cores']} cores (torch threads {m['torch_threads']}){ram}, "
            f"{dev}; Python {m['python']}, torch {m['torch']}, transformers {m['transformers']}, "
            f"mlflow {m['mlflow']}; {m['date']}")


def report(name: str, args, title: str, lines: list[str], payload: dict) -> None:
    """Print the Markdown (title, machine line, tables, notes) and write results/<name>[-tag].json/.md."""
    m = machine()
    stem = f"{name}-{args.tag}" if getattr(args, "tag", "") else name
    md = "\n".join([f"### {title}", "", machine_line(m), "", *lines]).rstrip() + "\n"
    print("\n" + md)
    RESULTS.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": name, "machine": m, "args": vars(args), **payload}
    (RESULTS / f"{stem}.json").write_text(json.dumps(payload, indent=1, default=str) + "\n")
    (RESULTS / f"{stem}.md").write_text(md)
    print(f"wrote {RESULTS / (stem + '.json')} and .md")
