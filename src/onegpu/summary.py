"""``onegpu summary``: the headline of the last pipeline run and the commands to go on with.

``make run`` calls it after ``dvc repro``. It reads only the DVC metrics files (``metrics/train.json``,
``metrics/eval.json``) and ``models/mlflow_run.json``: no MLflow, no torch, so it answers at once.
"""
from __future__ import annotations

from pathlib import Path

from onegpu import paths
from onegpu.errors import DataError
from onegpu.formatting import gib
from onegpu.measure.outside_load import METRIC

NEXT = """Next:
  onegpu ui          the MLflow UI: every run's per-step loss, memory and speed (link printed)
  dvc exp run --queue -S train.per_device_train_batch_size=4 -S train.gradient_accumulation_steps=4
  dvc queue start -j 1
                     a sweep: queue one line per micro-batch split, then run them one at a time
  onegpu compare     which runs trained the same model with another split, and what each cost
  onegpu tradeoffs   the guide's knobs measured on these params (6 steps per knob, more rounds only where
                     they can change the answer; the default job: 2 min on a 2-core CPU, where the
                     rows that compile run only with --knobs) and what is faster
  dvc exp show --only-changed --drop 'Created|State|Executor|models|data/|src/|model.dropout|test_loss|train_mem'
                     the sweep as a table (README.md: A sweep)"""


def text(cfg=None) -> str:
    """The summary: test and training headline figures, where the full set lives, the next commands.

    ``cfg`` (the params the pipeline ran with) gives the split; with ``auto`` it points to MLflow's
    ``resolved.*`` params, where the chosen split is logged.

    Raises:
        DataError: a metrics file is missing (the pipeline has not run here yet, or its training was
            stopped: then the message names the checkpoint kept).
    """
    for f in (paths.TRAIN_METRICS, paths.EVAL_METRICS):
        if not f.is_file():
            raise DataError(f"{f} is missing: {_stopped() or 'run the pipeline first (make run, or dvc repro)'}")
    tr, ev = paths.read_json(paths.TRAIN_METRICS), paths.read_json(paths.EVAL_METRICS)
    run = paths.read_json(paths.RUN_FILE).get("run_id", "?") if paths.RUN_FILE.is_file() else "?"
    test = " | ".join(f"perplexity {ev[k]:.1f}" if k == "test_perplexity" else
                      f"ROUGE-L {ev[k]:.3f}" if k == "test_rouge_l" else f"{k.removeprefix('test_')} {ev[k]:.4f}"
                      for k in ("test_accuracy", "test_rouge_l", "test_perplexity", "test_loss") if k in ev)
    if "test_rewards/accuracies" in ev:  # preference: the trained policy against where it started
        test += (f" | reward accuracy {ev['test_rewards/accuracies']:.3f} (the reference's own pairwise accuracy "
                 f"{ev['test_reference_accuracy']:.3f}) | margin {ev['test_rewards/margins']:.4f}")
    if "test_pass_rate" in ev:  # grpo: the trained policy against the model it started from
        test += (f"pass rate {ev['test_pass_rate']:.3f} (the starting model's {ev['test_start_pass_rate']:.3f}) | "
                 f"reward {ev['test_reward']:.3f} (the starting model's {ev['test_start_reward']:.3f})")
    train = [f"loss {tr['train_loss']:.4f}" if "train_loss" in tr else None,
             f"{tr['train_samples_per_second']:.1f} samples/s{' (under outside load)' if METRIC in tr else ''}"
             if "train_samples_per_second" in tr else None,
             f"peak {gib(tr['train_mem_peak_bytes'])}" if "train_mem_peak_bytes" in tr else None]
    if cfg is not None:
        t = cfg.train
        train.append("micro-batch auto (the split chosen: MLflow params resolved.*)"
                     if t.per_device_train_batch_size == "auto" else
                     f"{t.per_device_train_batch_size} x {t.gradient_accumulation_steps} per optimizer step")
    return (f"onegpu: done. Headline (metrics/*.json; every figure and per-step series in MLflow run {run}):\n"
            f"  test:  {test}\n  train: {' | '.join(x for x in train if x)}\n{_load_note(tr)}{_generations()}{NEXT}")


def _load_note(tr: dict) -> str:
    """A caution under the train line when the run trained under outside load (``train_outside_cpu_load``
    in metrics/train.json, written only then), or ''."""
    busy = tr.get(METRIC)
    if busy is None:
        return ""
    return (f"  measured under outside load: other processes kept {busy:.2f} CPUs busy while it trained, so "
            "its samples/s is not the cost of its settings alone (train again on a quiet machine to time it)\n")


def _generations(shown: int = 3) -> str:
    """The first ``shown`` test generations of instruction data (plots/generations.csv), or ''."""
    import csv
    if not paths.GENERATIONS.is_file():
        return ""
    with open(paths.GENERATIONS, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        return ""
    lines = [f"  generated (greedy) for {len(rows)} test prompts, the first {min(shown, len(rows))} "
             f"({paths.GENERATIONS}):"]
    for r in rows[:shown]:
        lines.append(f"    reference: {r['reference']}\n    generated: {' '.join(r['generation'].split())}")
    return "\n".join(lines) + "\n"


def _stopped() -> str:
    """For a stopped training: which one (its newest complete checkpoint under ``.onegpu/checkpoints``,
    the most recent of all configurations) and how to resume it; '' when none is kept."""
    from onegpu.training.lifecycle.resume import latest_checkpoint
    root = paths.project_root() / ".onegpu" / "checkpoints"
    found = [c for c in map(latest_checkpoint, sorted(root.glob("*"))) if c is not None]
    if not found:
        return ""
    c = max(found, key=lambda c: Path(c.path).stat().st_mtime)
    return (f"the last training was stopped after optimizer step {c.step} (MLflow run {c.run_id or '?'}; "
            f"checkpoint {paths.relative_to_root(c.path)}): make run (or dvc repro) resumes it")
