"""One ``onegpu tradeoffs`` batch: plan it, keep its plan, queue and run it, and measure its runs.

Experiments are named ``tradeoffs-<MMDD-HHMMSS>-<row>``; the MLflow runs carry the same names. The plan of
a batch is kept in ``<project root>/.onegpu/tradeoffs/<batch>.json`` so ``--report`` can list rows that
did not run. No MLflow here: the caller fetches the runs (:func:`measure` takes a function for it).
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from onegpu import paths
from onegpu.compare import RunRecord
from onegpu.config import Config, DeviceFacts, load
from onegpu.errors import ConfigError, UserError
from onegpu.formatting import GiB
from onegpu.tradeoffs import measurement, queue, windows as rounds
from onegpu.tradeoffs.knobs import Variant, plan as plan_knobs, with_overrides
from onegpu.tradeoffs.measurement import Row, aggregate, measure_row, measure_rows, repeat_name, unmeasured
from onegpu.tradeoffs.pool import WORKERS, Pool, run_rows as run_in_pool
from onegpu.tradeoffs.recommend import Recommendation, recommend
from onegpu.tradeoffs.rows import duration

PREFIX = "tradeoffs-"


def prefix(batch: str) -> str:
    """The experiment (and MLflow run) name prefix of ``batch``'s rows."""
    return f"{PREFIX}{batch}-"


def _manifest_dir() -> Path:
    return paths.project_root() / ".onegpu" / "tradeoffs"


def save(batch: str, variants: list[Variant], skipped: list[str], extra: dict) -> None:
    """Keep ``batch``'s plan (its variants, the knobs left out and why, ``extra``: params file, overrides)."""
    d = _manifest_dir()
    d.mkdir(parents=True, exist_ok=True)
    paths.write_json_atomic(d / f"{batch}.json", {
        "batch": batch, "skipped": skipped, **extra,
        "variants": [{"name": v.name, "knob": v.knob, "overrides": [list(o) for o in v.overrides],
                      "expect": v.expect, "what": v.what} for v in variants]})


def load_plan(batch: str | None) -> dict:
    """The kept plan of ``batch`` (with or without :data:`PREFIX`; None: the latest).

    Raises:
        UserError: no such batch, or none queued in this project yet.
    """
    d = _manifest_dir()
    files = sorted(d.glob("*.json"), key=lambda p: p.stat().st_mtime) if d.is_dir() else []
    if batch:
        batch = batch.removeprefix(PREFIX)
        files = [f for f in files if f.stem == batch]
        if not files:
            raise UserError(f"no tradeoffs batch {batch!r} in {d} (batches there: "
                            f"{', '.join(p.stem for p in sorted(d.glob('*.json'))) or 'none'})")
    if not files:
        raise UserError("no tradeoffs batch queued in this project yet: run `onegpu tradeoffs` first")
    return json.loads(files[-1].read_text())


def variants_of(manifest: dict) -> list[Variant]:
    return [Variant(v["name"], v["knob"], tuple(tuple(o) for o in v["overrides"]), v["expect"], v["what"])
            for v in manifest["variants"]]


def plan(cfg: Config, params: str, knobs: tuple[str, ...] | None, overrides: list[str],
         facts: DeviceFacts) -> tuple[list[Variant], list[str]]:
    """The batch's variants with the command's ``-S`` ``overrides`` first in each, and the knobs left out.

    Raises:
        UserError: a variant's params do not validate (a LoRA row on a model peft cannot adapt fails
            later, at train).
    """
    variants, skipped = plan_knobs(cfg, facts, knobs)
    variants = with_overrides(variants, [tuple(o.split("=", 1)) for o in overrides])
    for v in variants:
        try:
            load(params, v.assignments)
        except ConfigError as e:
            raise UserError(f"row {v.name} ({v.set_text}) does not validate: {e}") from None
    return variants, skipped


# The probe window's default (``--steps``): optimizer steps per row, whatever the job's length. Step 1 holds
# warm-up (its time is its own column); steps 2..N give samples/s and, against the baseline's, the verdict.
PROBE_STEPS = 6
# The most windows of a row (``--repeats R`` forces R of every row): the rows run in interleaved rounds, and
# after the first only the baseline and the rows whose next window could change the answer run again.
REPEATS = rounds.REPEATS


# How a batch's rows ran (its plan's "runner"): in a pool of worker processes, or each as its own DVC experiment.
DVC_TEMP = "dvc exp run --temp"


# What a probe window switches off besides: validation during training (a pass costs about as much as a few
# steps of the default job, and the window measures the steps), and with it what needs validation points.
NO_VALIDATION = ["train.eval_strategy=no", "train.load_best_model_at_end=false", "train.early_stopping_patience=null"]


def window(steps: int | None) -> list[str]:
    """The probe window as ``key=value``, put before each row's own overrides (every row, the baseline
    too, trains ``steps`` optimizer steps, without validation: :data:`NO_VALIDATION`; the learning-rate
    schedule then spans those steps); none for ``--full`` (``steps`` None). Not a row's override: a
    recommendation never carries it."""
    return [] if steps is None else [f"train.max_steps={steps}", *NO_VALIDATION]


def window_args(steps: int | None) -> list[str]:
    """:func:`window` as ``dvc exp run``'s ``-S`` arguments."""
    return [a for kv in window(steps) for a in ("-S", kv)]


def order(variants: list[Variant], repeats: int) -> list[Variant]:
    """The rows to run, interleaved: round 1 (baseline, each knob), round 2, ...; repeat ``r`` is named
    :func:`~onegpu.tradeoffs.measurement.repeat_name` ``(name, r)``: a drift of the machine's speed
    during the batch then hits every row alike."""
    return [Variant(repeat_name(v.name, r), v.knob, v.overrides, v.expect, v.what)
            for r in range(1, repeats + 1) for v in variants]


def _check_queue() -> None:
    running = [n for n, s in queue.states().items() if s == "Running"]
    if running:
        raise UserError(f"{len(running)} experiment(s) running from the DVC queue ({', '.join(running[:5])}): "
                        "they would share the machine and skew the timings; wait for them (dvc queue status) "
                        "or stop them (dvc queue kill ...)")


def start(cfg: Config, params: str, knobs: tuple[str, ...] | None, overrides: list[str], queue_only: bool,
          facts: DeviceFacts, steps: int | None = PROBE_STEPS, repeats: int | None = None,
          pool: Pool | None = None, fetch: Callable[[str], dict[str, RunRecord]] | None = None) -> tuple[str, bool]:
    """Plan, keep the batch's plan, and queue its experiments (``queue_only``) or run them one at a time
    in interleaved rounds, each row ``steps`` optimizer steps up to the train stage (None: the whole job,
    evaluate too); return the batch id and whether Ctrl-C stopped it. ``repeats``: R rounds of every row
    (:func:`order`); None: up to :data:`REPEATS`, a row running again only while its next window could
    change the recommendation (:func:`run_rounds`; ``fetch(prefix)``: the batch's runs so far, as
    :func:`finished_runs`). ``pool``: train the rows in these workers (:mod:`onegpu.tradeoffs.pool`)
    instead of as ``dvc exp run --temp``.

    Raises:
        UserError: experiments are running from the DVC queue (they would share the machine), a row
            does not validate, or dvc could not queue one.
    """
    own = [o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0].strip() == "train.max_steps"]
    if steps is not None and own and own[-1].strip().lstrip("-").isdigit() and int(own[-1]) > 0:
        steps = int(own[-1])  # the user's own -S train.max_steps is the window
    variants, skipped = plan(cfg, params, knobs, list(overrides), facts)
    if not queue_only:
        _check_queue()
    batch = time.strftime("%m%d-%H%M%S")
    adaptive = repeats is None and not queue_only and fetch is not None
    in_workers = pool is not None and not queue_only
    extra = {"params": params, "overrides": overrides, "steps": steps,
             "repeats": 1 if queue_only else repeats or REPEATS, "forced": not adaptive,
             "runner": WORKERS if in_workers else DVC_TEMP}
    save(batch, variants, skipped, extra)
    what = (f"{steps} optimizer steps each, up to train" if steps else "the whole job each, evaluate too") + (
        ", in worker processes on data prepared once" if in_workers else "")
    span = rounds.window_range(variants, extra["repeats"], adaptive)
    print(f"onegpu tradeoffs: {_windows_text(variants, extra['repeats'], span, adaptive)} from {params}"
          + "".join(f" -S {o}" for o in overrides) + f" ({what}; batch {batch})")
    print("  " + expected_time(span, steps, extra["runner"], batch))
    if paths.params_differ_from_head(params):  # e.g. what a workspace `dvc exp run -S` left there
        print(f"  note: {params} differs from git's HEAD (`git diff {params}`): the baseline is the file as it is")
    for s in skipped:
        print(f"  not measured: {s}")
    if queue_only:
        queue.queue(prefix(batch), variants, [] if steps is None else ["train"], window_args(steps))
        print(f"\nnext: dvc queue start -j 1   (one at a time: timings need the machine alone)\n"
              f"then, when `dvc queue status` shows them done: onegpu tradeoffs --report --batch {batch}")
        return batch, False
    if adaptive:
        return batch, run_rounds(batch, variants, REPEATS, steps, params, pool, lambda: fetch(prefix(batch)))
    return batch, run(batch, order(variants, extra["repeats"]), steps, params, pool)


def _windows_text(variants: list[Variant], repeats: int, span: tuple[int, int], adaptive: bool) -> str:
    """The plan's windows in words: forced (``R rows x R repeat(s)``), or the ``span`` of the adaptive rounds
    (:func:`onegpu.tradeoffs.windows.window_range`)."""
    if not adaptive:
        return f"{len(variants)} rows x {repeats} repeat(s)"
    once = len(variants) - rounds.reopenable(variants)  # rows of another training: one window
    return (f"{len(variants)} rows, one window each, then up to {repeats - 1} more rounds of the baseline and of "
            f"each row whose next window could still change the recommendation ({once} of another training run "
            f"once): {span[0]} to {span[1]} windows")


def expected_time(windows: tuple[int, int], steps: int | None, runner: str, batch: str) -> str:
    """The batch's expected wall time in words: ``windows`` (the fewest and most) times the median wall
    time of a baseline window in this project's latest earlier batch with the same window and runner (its
    params may differ: it says which batch; the baseline, in every batch, compiles nothing, so a batch
    of rows that met a cold compiler cache does not inflate it; no baseline: its median row); before any,
    that it is known after the first row."""
    import statistics
    earlier = sorted(_manifest_dir().glob("*.json"), key=lambda p: p.stat().st_mtime, reverse=True)
    for f in earlier:
        m = json.loads(f.read_text())
        if m.get("batch") != batch and m.get("wall_s") and m.get("steps") == steps and m.get("runner") == runner:
            base = [w for n, w in m["wall_s"].items() if n == "baseline" or n.startswith("baseline-r")]
            per = statistics.median(base or m["wall_s"].values())
            span = " to ".join(dict.fromkeys(duration(w * per) for w in windows))
            return (f"expected: about {span} (a {'baseline window' if base else 'row'} took a median {per:.1f} s "
                    f"in batch {m['batch']} here)")
    return "expected time: known after the first row (no earlier batch with this window here)"


def run_rounds(batch: str, variants: list[Variant], repeats: int, steps: int | None, params: str | None,
               pool: Pool | None, fetch: Callable[[], dict[str, RunRecord]]) -> bool:
    """Round 1: every row; rounds 2..``repeats``: the baseline and the rows still open
    (:func:`onegpu.tradeoffs.windows.next_round`, measured on ``fetch()``), until none is. Each row's
    count of windows is kept in the plan (``windows``); return whether Ctrl-C stopped the batch."""
    counts = {v.name: 1 for v in variants}
    _keep_windows(batch, counts)
    interrupted = run(batch, order(variants, 1), steps, params, pool)
    for r in range(2, repeats + 1):
        if interrupted:
            break
        again = rounds.next_round(variants, measure_rows(variants, fetch(), counts), repeats)
        if not again:
            print(f"\nround {r}: no row is left whose next window could change the recommendation")
            break
        print(f"\nround {r} of at most {repeats}: the baseline and {len(again) - 1} row(s) whose gain could "
              f"still clear the spread: {', '.join(v.name for v in again if v.knob != rounds.BASELINE)}")
        counts.update({v.name: r for v in again})
        _keep_windows(batch, counts)
        interrupted = run(batch, [Variant(repeat_name(v.name, r), v.knob, v.overrides, v.expect, v.what)
                                  for v in again], steps, params, pool)
    return interrupted


def _keep_windows(batch: str, counts: dict[str, int]) -> None:
    manifest = load_plan(batch)
    manifest["windows"] = dict(counts)
    paths.write_json_atomic(_manifest_dir() / f"{batch}.json", manifest)


def _unchanged(params: str, v: Variant, steps: int | None) -> bool:
    """``v``'s overrides with the window (``steps``) leave ``params`` as it is (then dvc.lock may hold its
    train stage already)."""
    return load(params, window(steps) + v.assignments) == load(params)


def run(batch: str, rows: list[Variant], steps: int | None, params: str | None, pool: Pool | None = None) -> bool:
    """Run ``rows`` of ``batch`` (in ``pool``'s workers, else :func:`queue.run_rows`) and keep each one's
    wall time and the ones Ctrl-C stopped in its plan; return whether it was interrupted. ``params``: the
    params file (None: no row needs ``--force``)."""
    if pool is not None:
        ran, interrupted = run_in_pool(pool, prefix(batch), rows, window(steps))
    else:
        # A baseline whose -S change nothing may be what dvc.lock holds already: --force makes it train again
        # instead of finding nothing to do (--force re-runs prepare too, so only where it is needed).
        force = {v.name for v in rows if v.knob == "baseline" and params and _unchanged(params, v, steps)}
        ran, interrupted = queue.run_rows(prefix(batch), rows, [] if steps is None else ["train"], force,
                                          window=window_args(steps))
    manifest = load_plan(batch)
    if pool is not None:
        manifest["ready_s"] = pool.ready_s  # the workers' start and data, before the rows (Pool.ready)
    manifest.setdefault("wall_s", {}).update({r.name.removeprefix(prefix(batch)): r.seconds for r in ran})
    manifest["stopped"] = manifest.get("stopped", []) + [r.name.removeprefix(prefix(batch)) for r in ran
                                                         if r.returncode is None]
    paths.write_json_atomic(_manifest_dir() / f"{batch}.json", manifest)
    return interrupted


def finished_runs(records: list[RunRecord], name_prefix: str) -> dict[str, RunRecord]:
    """Each row's training run by row name (``records`` oldest first, named ``<prefix><row>``): of
    several runs with one name (a re-run), the latest that finished its training, else the latest (a
    stopped or failed one, which the row then reports as such)."""
    out: dict[str, RunRecord] = {}
    for r in records:
        name = r.name.removeprefix(name_prefix)
        if unmeasured(r) is None or name not in out or unmeasured(out[name]) is not None:
            out[name] = r
    return out


@dataclass
class Measured:
    """A batch measured: one row per variant, the recommendation, and the recommendation's own row (a
    single knob's row, or the combination's runs; None: not run); ``interrupted``: Ctrl-C stopped it."""
    rows: list[Row]
    recommendation: Recommendation
    measured: Row | None
    interrupted: bool = False

    @property
    def combined(self) -> bool:
        """The recommendation combines several knobs (it has a run of its own)."""
        v = self.recommendation.variant
        return v is not None and v.knob == "recommended"


def budget_bytes(cfg: Config, facts: DeviceFacts) -> float | None:
    """``train.memory_budget_gib`` in bytes; else the free CUDA memory; on CPU without a budget, None."""
    if cfg.train.memory_budget_gib:
        return cfg.train.memory_budget_gib * GiB
    if facts.cuda:  # as the `auto` micro-batch finder: the device's free memory
        from onegpu.measure import memory as device
        return float(device.free_bytes("cuda"))
    return None


def row_states(manifest: dict, queued: dict[str, str]) -> dict[str, str]:
    """Each repeat's state by row name where its MLflow run cannot tell: ``Stopped`` (Ctrl-C stopped it,
    kept in the plan) or its ``dvc queue status`` word (``queued``: by experiment name)."""
    name_prefix = prefix(manifest["batch"])
    out = {k.removeprefix(name_prefix): v for k, v in queued.items() if k.startswith(name_prefix)}
    out.update({name: "Stopped" for name in manifest.get("stopped", [])})
    return out


PROBE_NOTE = "no eval metrics (evaluate has not run)"


def measure(manifest: dict, fetch: Callable[[], dict[str, RunRecord]], budget: float | None,
            combine: bool, report_only: bool, where: str, queued: dict[str, str] | None = None,
            interrupted: bool = False, pool: Pool | None = None) -> Measured:
    """Measure the batch's runs (``fetch()``: :func:`finished_runs` of the store) against its baseline and
    recommend; with ``combine`` (and not ``report_only`` or ``interrupted``), run the combination first
    (its own repeats) when it has no run yet, and keep it only when its repeats confirm the gain.

    ``budget``: bytes (None: no budget); ``where``: the MLflow experiment, for the message; ``queued``:
    ``dvc queue status`` by experiment name; ``pool``: where the combination trains (None: ``dvc exp
    run --temp``). A batch with a row missing recommends nothing.
    """
    variants, most = variants_of(manifest), manifest.get("repeats", 1)
    counts = manifest.get("windows") or {v.name: most for v in variants}  # each row's windows (forced: all alike)
    repeats = counts.get("baseline", most)  # the combination's windows: the baseline's
    runs, states = fetch(), row_states(manifest, queued or {})
    rows = measure_rows(variants, runs, counts, states)
    for r in rows:
        if manifest.get("steps"):  # probe rows skip evaluate by design
            r.notes = [n for n in r.notes if n != PROBE_NOTE]
        n = counts.get(r.variant.name, 1)
        if r.run is not None and n < most and (why := rounds.decided(r, most)):
            r.notes.append(f"{n} window{'s' * (n > 1)}: decided, not timed further ({why})")
    out = Measured(rows, recommend(rows, budget), None, interrupted)
    rec = out.recommendation
    if out.combined and "recommended" not in runs and combine and not report_only and not interrupted:
        print(f"\n{len(rec.parts)} knobs were faster with the same training: measuring them together, "
              f"{repeats} time(s) ({rec.variant.what})")
        together = order([rec.variant], repeats)
        out.interrupted = run(manifest["batch"], together, manifest.get("steps"), None, pool)
        runs = fetch()
    if rec.variant is not None:
        out.measured = (_combined(rec.variant, runs, repeats, row_states(load_plan(manifest["batch"]), {}))
                        if out.combined else next(r for r in rows if r.variant.name == rec.variant.name))
    return out


def _combined(v: Variant, runs: dict[str, RunRecord], repeats: int, states: dict[str, str]) -> Row:
    """The combination's row over its repeats, each against the baseline of the same round."""
    return aggregate(v, [measure_row(v, runs.get(repeat_name(v.name, r)), runs.get(repeat_name("baseline", r)),
                                     states.get(repeat_name(v.name, r))) for r in range(1, repeats + 1)])


def timing(manifest: dict, runs: dict[str, RunRecord]) -> list[str]:
    """The rows' cost in words, from the wall time of each row kept in the plan and its run's
    ``train_runtime``: the whole, and the per-row overhead that a row pays whatever its window (as
    ``dvc exp run --temp``: DVC's temporary clone, each stage's process start, the model's load and save;
    in workers: the model's build and the MLflow run), the seconds the rows' steps spent compiling
    (``step_compile_s``: warm-up, said apart since no window's samples/s counts it), and the workers' start
    with the data's preparation before the rows (``ready_s``, :meth:`onegpu.tradeoffs.pool.Pool.ready`).
    Empty before any row ran here (a queued batch)."""
    wall = manifest.get("wall_s", {})
    if not wall:
        return []
    pairs = [(w, runs[n].metrics["train_runtime"]) for n, w in wall.items()
             if n in runs and "train_runtime" in runs[n].metrics]
    workers = manifest.get("runner") == WORKERS
    how = "rows in worker processes" if workers else "dvc exp run --temp"
    out = [f"the rows took {sum(wall.values()):.0f} s of wall time ({len(wall)} {how}, one at a time)"]
    compiled = {n: sum(measurement.compiled_by_step(runs[n]).values()) for n in wall if n in runs}
    if any(compiled.values()):
        out[0] += (f", {sum(compiled.values()):.0f} s of it compiling (warm-up: torch.compile, torchao's optimizer "
                   f"step; in no window's samples/s) in {sum(1 for c in compiled.values() if c)} of them")
    if pairs:
        over = sorted(w - t for w, t in pairs)
        what = ("the model's build and its MLflow run" if workers
                else "DVC's temporary clone, each stage's process start, model load and save")
        out[0] += (f"; per row a median {over[len(over) // 2]:.1f} s (min {over[0]:.1f}, max {over[-1]:.1f}) "
                   f"beyond its training: {what}")
    if manifest.get("ready_s"):
        out[0] += (f"; before the rows, {manifest['ready_s']:.0f} s starting the workers (at once) and preparing "
                   "the data")
    return out
