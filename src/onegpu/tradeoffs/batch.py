"""One ``onegpu tradeoffs`` batch: plan it, keep its plan, queue and run it, and measure its runs.

Experiments are named ``tradeoffs-<MMDD-HHMMSS>-<row>``; the MLflow runs carry the same names. The plan of
a batch is kept in ``<project root>/.onegpu/tradeoffs/<batch>.json`` so ``--report`` can list rows that
did not run. No MLflow here: the caller fetches the runs (:func:`measure` takes a function for it).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from onegpu import paths
from onegpu.compare import RunRecord
from onegpu.config import Config, DeviceFacts, load
from onegpu.errors import ConfigError, UserError
from onegpu.formatting import GiB
from onegpu.tradeoffs import queue
from onegpu.tradeoffs.knobs import Variant, plan as plan_knobs, with_overrides
from onegpu.tradeoffs.measurement import Row, measure_row, measure_rows
from onegpu.tradeoffs.recommend import Recommendation, recommend

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


def plan(cfg: Config, params: str, knobs: tuple[str, ...], overrides: list[str],
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
            load(params, [f"{k}={val}" for k, val in v.overrides])
        except ConfigError as e:
            raise UserError(f"row {v.name} ({v.set_text}) does not validate: {e}") from None
    return variants, skipped


def start(cfg: Config, params: str, knobs: tuple[str, ...], overrides: list[str], queue_only: bool,
          facts: DeviceFacts) -> str:
    """Plan, check the queue, keep the batch's plan, queue its experiments and (unless ``queue_only``)
    run them one at a time; return the batch id.

    Raises:
        UserError: other experiments are queued (they would run too and share the machine), a row does
            not validate, or dvc could not queue one.
    """
    variants, skipped = plan(cfg, params, knobs, overrides, facts)
    others = [] if queue_only else queue.in_queue()
    if others:
        raise UserError(f"{len(others)} experiment(s) already in the DVC queue ({', '.join(others[:5])}): "
                        "they would run with these and skew the timings; run them first "
                        "(dvc queue start) or remove them (dvc queue remove --queued), or use --queue-only")
    batch = time.strftime("%m%d-%H%M%S")
    save(batch, variants, skipped, {"params": params, "overrides": overrides})
    print(f"onegpu tradeoffs: {len(variants)} experiments from {params}"
          + "".join(f" -S {o}" for o in overrides) + f" (batch {batch}):")
    if paths.params_differ_from_head(params):  # e.g. what a workspace `dvc exp run -S` left there
        print(f"  note: {params} differs from git's HEAD (`git diff {params}`): the baseline is the file as it is")
    queue.queue(prefix(batch), variants)
    for s in skipped:
        print(f"  not measured: {s}")
    if queue_only:
        print(f"\nnext: dvc queue start -j 1   (one at a time: timings need the machine alone)\n"
              f"then, when `dvc queue status` shows them done: onegpu tradeoffs --report --batch {batch}")
    else:
        queue.run_all({f"{prefix(batch)}{v.name}" for v in variants})
    return batch


def finished_runs(records: list[RunRecord], name_prefix: str) -> dict[str, RunRecord]:
    """Each row's finished training run by row name (``records`` oldest first, named ``<prefix><row>``);
    of several runs with one name (a re-run), the latest."""
    return {r.name.removeprefix(name_prefix): r for r in records
            if r.status not in ("FAILED", "KILLED") and "train_runtime" in r.metrics}


@dataclass
class Measured:
    """A batch measured: one row per variant, the recommendation, and the recommendation's own row (a
    single knob's row, or the combination's run; None: not run)."""
    rows: list[Row]
    recommendation: Recommendation
    measured: Row | None

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
        from onegpu import measure as device
        return float(device.free_bytes("cuda"))
    return None


def measure(manifest: dict, fetch: Callable[[], dict[str, RunRecord]], budget: float | None,
            combine: bool, report_only: bool, where: str) -> Measured:
    """Measure the batch's runs (``fetch()``: :func:`finished_runs` of the store) against its baseline and
    recommend; with ``combine`` (and not ``report_only``), queue and run the combination first when it
    has no run yet.

    ``budget``: bytes (None: no budget); ``where``: the MLflow experiment, for the message.
    Raises:
        UserError: the baseline has no finished training run.
    """
    name_prefix = prefix(manifest["batch"])
    runs = fetch()
    if "baseline" not in runs:
        raise UserError(f"no finished training run named {name_prefix}baseline in {where}: see "
                        f"`dvc queue logs {name_prefix}baseline`"
                        + (" (or wait for the queue: dvc queue status)" if report_only else ""))
    rows = measure_rows(variants_of(manifest), runs)
    out = Measured(rows, recommend(rows, budget), None)
    rec = out.recommendation
    if out.combined and "recommended" not in runs and combine and not report_only:
        print(f"\n{len(rec.parts)} knobs were faster with the same training: measuring them together "
              f"({rec.variant.what})")
        queue.queue(name_prefix, [rec.variant])
        queue.run_all({f"{name_prefix}{rec.variant.name}"})
        runs = fetch()
    if rec.variant is not None:
        out.measured = (measure_row(rec.variant, runs.get("recommended"), runs["baseline"]) if out.combined
                        else next(r for r in rows if r.variant.name == rec.variant.name))
    return out
