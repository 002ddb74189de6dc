"""``onegpu tradeoffs``: the single-GPU guide's table, measured on the user's own model and data.

Queues the baseline (the user's params) and one DVC experiment per knob (:func:`onegpu.tradeoffs.plan`),
runs them one at a time (``dvc exp run --run-all -j 1``: speed is only comparable without other load),
reads their MLflow runs, and when several knobs were faster without changing the training, queues and
runs their combination too. Writes ``<out>/tradeoffs.md`` and ``<out>/tradeoffs.png``, logs both to an
MLflow run (tag ``stage=tradeoffs``) and prints the table.

Experiments are named ``tradeoffs-<MMDD-HHMMSS>-<row>``; the MLflow runs carry the same names. The plan of
a batch is kept in ``<project root>/.onegpu/tradeoffs/<batch>.json`` so ``--report`` can list rows that
did not run.
"""
from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from onegpu import equivalence, measure, paths, tracking, tradeoffs, tradeoffs_report
from onegpu.config import Config, load
from onegpu.errors import ConfigError, UserError

PREFIX = "tradeoffs-"


def parse_knobs(text: str | None) -> tuple[str, ...]:
    """``--knobs split,bf16,...`` as a tuple of :data:`onegpu.tradeoffs.KNOBS` (None: all of them).

    Raises:
        UserError: an unknown name or an empty list.
    """
    if text is None:
        return tradeoffs.KNOBS
    knobs = tuple(k.strip() for k in text.split(",") if k.strip())
    bad = [k for k in knobs if k not in tradeoffs.KNOBS]
    if bad or not knobs:
        raise UserError(f"--knobs {text!r}: {'unknown ' + ', '.join(bad) if bad else 'empty'}; choose from "
                        f"{','.join(tradeoffs.KNOBS)}")
    return knobs


def _dvc() -> str:
    """The ``dvc`` executable: next to this Python's (the project's venv), else on PATH."""
    local = Path(sys.executable).parent / "dvc"
    return str(local) if local.exists() else (shutil.which("dvc") or "dvc")


def _dvc_call(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([_dvc(), *args], capture_output=True, text=True)


def _manifest_dir() -> Path:
    return paths.project_root() / ".onegpu" / "tradeoffs"


def _save_manifest(batch: str, variants: list[tradeoffs.Variant], skipped: list[str], extra: dict) -> None:
    d = _manifest_dir()
    d.mkdir(parents=True, exist_ok=True)
    paths.write_json_atomic(d / f"{batch}.json", {
        "batch": batch, "skipped": skipped, **extra,
        "variants": [{"name": v.name, "knob": v.knob, "overrides": [list(o) for o in v.overrides],
                      "expect": v.expect, "what": v.what} for v in variants]})


def _load_manifest(batch: str | None) -> dict:
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


def _variants(manifest: dict) -> list[tradeoffs.Variant]:
    return [tradeoffs.Variant(v["name"], v["knob"], tuple(tuple(o) for o in v["overrides"]), v["expect"], v["what"])
            for v in manifest["variants"]]


def _other_queued() -> list[str]:
    """Experiments queued or running in this project's DVC queue (``dvc queue status`` rows)."""
    p = _dvc_call("queue", "status")
    rows = [line.split() for line in p.stdout.splitlines()]
    return [r[1] if len(r) > 1 else r[0] for r in rows if any(w in ("Queued", "Running") for w in r)]


def _wait_for(names: set[str], poll_s: float = 3.0) -> None:
    """Until none of ``names`` is queued or running. ``dvc exp run --run-all`` can return at once while a
    queue worker of an earlier call, still alive, runs a task just queued (it found nothing queued)."""
    said = False
    while busy := [n for n in _other_queued() if n in names]:
        if not said:
            print(f"waiting for {', '.join(busy)} (still in the DVC queue)", flush=True)
            said = True
        time.sleep(poll_s)


def _check_variants(params: str, variants: list[tradeoffs.Variant]) -> None:
    """Each variant's params validate (a LoRA row on a model peft cannot adapt fails later, at train)."""
    for v in variants:
        try:
            load(params, [f"{k}={val}" for k, val in v.overrides])
        except ConfigError as e:
            raise UserError(f"row {v.name} ({v.set_text}) does not validate: {e}") from None


def _queue(prefix: str, variants: list[tradeoffs.Variant]) -> None:
    for v in variants:
        name = f"{prefix}{v.name}"
        # The baseline's params may be what dvc.lock already holds: --force makes it train again instead of
        # finding nothing to do. Every other row changes a param of train, so train runs anyway and
        # prepare is reused when it is up to date.
        force = ["--force"] if v.knob == "baseline" else []
        p = _dvc_call("exp", "run", "--queue", *force, "--name", name, *v.set_args)
        if p.returncode != 0:
            last = (p.stderr.strip() or p.stdout.strip()).splitlines()[-1:] or ["?"]
            raise UserError(f"dvc could not queue experiment {name}: {last[0]}")
        print(f"  queued {name}  {v.set_text or '(your params)'}")


def _run_queue(names: set[str]) -> None:
    """Run every queued experiment, one at a time, following their logs (``dvc exp run --run-all -j 1``),
    and wait until ``names`` (the experiments this command queued) have left the queue."""
    print("running the queue one experiment at a time (dvc exp run --run-all -j 1); Ctrl+C stops following "
          "the logs, the experiments go on (then `onegpu tradeoffs --report`)", flush=True)
    subprocess.run([_dvc(), "exp", "run", "--run-all", "-j", "1"])
    _wait_for(names)


def _budget_bytes(cfg: Config) -> float | None:
    """``train.memory_budget_gib`` in bytes; else the free CUDA memory; on CPU without a budget, None."""
    if cfg.train.memory_budget_gib:
        return cfg.train.memory_budget_gib * 2**30
    if measure.cuda_available():  # as the `auto` micro-batch finder: the device's free memory
        return float(measure.free_bytes("cuda"))
    return None


def _runs(tracker, prefix: str) -> dict[str, equivalence.RunRecord]:
    """Each row's training run by row name; of several runs with one name (a re-run), the latest."""
    out = {}
    for d in tracking.training_runs_named(tracker, prefix):
        r = equivalence.RunRecord(**d)
        if r.status in ("FAILED", "KILLED") or "train_runtime" not in r.metrics:
            continue
        out[r.name.removeprefix(prefix)] = r  # oldest first: the latest wins
    return out


def _plan(cfg: Config, params: str, knobs: tuple[str, ...],
          overrides: list[str]) -> tuple[list[tradeoffs.Variant], list[str]]:
    cuda = measure.cuda_available()
    bf16 = True
    if cuda:
        import torch
        bf16 = torch.cuda.is_bf16_supported()
    variants, skipped = tradeoffs.plan(cfg, cuda=cuda, bf16_supported=bf16,
                                       bnb_available=importlib.util.find_spec("bitsandbytes") is not None,
                                       knobs=knobs)
    variants = tradeoffs.with_overrides(variants, [tuple(o.split("=", 1)) for o in overrides])
    _check_variants(params, variants)
    return variants, skipped


def run(cfg: Config, params: str = "params.yaml", knobs: tuple[str, ...] = tradeoffs.KNOBS,
        queue_only: bool = False, report_only: bool = False, batch: str | None = None,
        combine: bool = True, out_dir: str | Path = "reports", overrides: list[str] = ()) -> list[tradeoffs.Row]:
    """Queue, run and report (see the module docstring); ``cfg`` is the params file with ``overrides``
    (``-S key=value``, applied to every experiment, the baseline too) applied; ``queue_only``: queue and stop;
    ``report_only``: report on ``batch`` (default: the latest) without queueing or running anything;
    ``combine``: queue and run the combined recommendation when it needs its own run.

    Returns:
        The measured rows (baseline first; the combined recommendation last when it ran).
    Raises:
        UserError: not in a DVC project, other experiments queued (they would run too and share the
            machine), a row whose params do not validate, dvc failing to queue, no MLflow store or runs.
    """
    if not Path("dvc.yaml").is_file():
        raise UserError("no dvc.yaml here: run onegpu tradeoffs from the project root")
    if not report_only:
        batch = _start(cfg, params, knobs, list(overrides), queue_only)
        if queue_only:
            return []
    manifest = _load_manifest(batch)
    batch = manifest["batch"]
    prefix = f"{PREFIX}{batch}-"
    tracker = tracking.open_existing(cfg.tracking.experiment_name)
    tracker.reap_orphans()
    runs = _runs(tracker, prefix)
    if "baseline" not in runs:
        raise UserError(f"no finished training run named {prefix}baseline in MLflow experiment "
                        f"{cfg.tracking.experiment_name!r}: see `dvc queue logs {prefix}baseline`"
                        + (" (or wait for the queue: dvc queue status)" if report_only else ""))
    rows = tradeoffs.measure_rows(_variants(manifest), runs)
    rec = tradeoffs.recommend(rows, _budget_bytes(cfg))
    combined = rec.variant is not None and rec.variant.knob == "recommended"
    if combined and "recommended" not in runs and combine and not report_only:
        print(f"\n{len(rec.parts)} knobs were faster with the same training: measuring them together "
              f"({rec.variant.what})")
        _queue(prefix, [rec.variant])
        _run_queue({f"{prefix}{rec.variant.name}"})
        runs = _runs(tracker, prefix)
    # The recommendation's measured row: a single knob's own row, or the combination's run (None: not run).
    measured = None if rec.variant is None else (
        tradeoffs.measure_row(rec.variant, runs.get("recommended"), runs["baseline"]) if combined
        else next(r for r in rows if r.variant.name == rec.variant.name))
    _report(tracker, batch, manifest, rows, rec, measured, out_dir)
    return rows + ([measured] if combined else [])


def _start(cfg: Config, params: str, knobs: tuple[str, ...], overrides: list[str], queue_only: bool) -> str:
    """Plan, check the queue, save the batch's plan, queue its experiments and (unless ``queue_only``)
    run them; return the batch id."""
    variants, skipped = _plan(cfg, params, knobs, overrides)
    if not queue_only:
        others = _other_queued()
        if others:
            raise UserError(f"{len(others)} experiment(s) already in the DVC queue ({', '.join(others[:5])}): "
                            "they would run with these and skew the timings; run them first "
                            "(dvc queue start) or remove them (dvc queue remove --queued), or use "
                            "--queue-only")
    batch = time.strftime("%m%d-%H%M%S")
    prefix = f"{PREFIX}{batch}-"
    _save_manifest(batch, variants, skipped, {"params": params, "overrides": overrides})
    print(f"onegpu tradeoffs: {len(variants)} experiments from {params}"
          + "".join(f" -S {o}" for o in overrides) + f" (batch {batch}):")
    if paths.params_differ_from_head(params):  # e.g. what a workspace `dvc exp run -S` left there
        print(f"  note: {params} differs from git's HEAD (`git diff {params}`): the baseline is the file as it is")
    _queue(prefix, variants)
    for s in skipped:
        print(f"  not measured: {s}")
    if queue_only:
        print(f"\nnext: dvc queue start -j 1   (one at a time: timings need the machine alone)\n"
              f"then, when `dvc queue status` shows them done: onegpu tradeoffs --report --batch {batch}")
    else:
        _run_queue({f"{prefix}{v.name}" for v in variants})
    return batch


def _report(tracker, batch: str, manifest: dict, rows: list[tradeoffs.Row], rec: tradeoffs.Recommendation,
            measured: tradeoffs.Row | None, out_dir: str | Path) -> None:
    """Write the report files, log them and the ratios to an MLflow run, print the table."""
    title = f"onegpu tradeoffs {batch}" + "".join(f" -S {o}" for o in manifest.get("overrides", []))
    files = tradeoffs_report.write(rows, rec, measured, out_dir, title, manifest.get("skipped", []))
    shown = rows + tradeoffs_report.combined_row(measured)
    metrics = {f"speedup/{r.variant.name}": r.speedup for r in rows if r.speedup is not None}
    metrics.update({f"memory_ratio/{r.variant.name}": r.memory_ratio for r in rows if r.memory_ratio is not None})
    if measured is not None and measured.speedup is not None:
        metrics["recommended_speedup"] = measured.speedup
    run_id = tracking.log_comparison(tracker, files, [r.run.run_id for r in shown if r.run],
                                     sorted({r.run.key for r in shown if r.run and r.run.key}),
                                     metrics, stage="tradeoffs", name=f"{PREFIX}{batch}")
    print()
    print(tradeoffs_report.terminal(rows, rec, measured), end="")
    print(f"\nreport: {files[0]} (plot {files[1].name}); MLflow run {run_id} ({PREFIX}{batch})")
