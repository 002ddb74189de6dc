"""Against the peer: onegpu's train stage versus plain HF Trainer with report_to=["mlflow"].

Both arms train the same model init (same seed), data, collator and TrainingArguments values
(``onegpu.training.backends.hf_trainer.training_arguments``: logging_steps=1, no checkpoints, no evaluation)
in one process, the order alternating between repetitions:

- ours: what ``onegpu.stages.train`` does (``arms.stage_run``): run + params + tags into MLflow,
  ``onegpu.training.tracked_run.run`` with the trainer backend (``ExactLossTrainer``, the step-measurement
  callbacks, the activation probe at train begin, Ctrl-C handling) with the batched MLflow writer as sink
  and MLflow's system-metrics monitor running, then flush, summary metrics and end_run;
- plain: ``transformers.Trainer`` with the same arguments except ``report_to=["mlflow"]``, so HF's
  ``MLflowCallback`` starts the run, logs every TrainingArguments and model-config value as params and
  every step's logs (``log_metrics(..., synchronous=False)``), and ends the run; the store is a
  temporary SQLite file named by ``MLFLOW_TRACKING_URI``.

Throughput = examples trained / wall time of the whole arm (building TrainingArguments and the trainer,
training, all MLflow work; the model is built before the clock starts in both). Also the steady-state
step time (steps 2..N): from onegpu's own recorder for ours, from a time stamp at each ``on_step_end``
for plain. Median over repetitions; target ours/plain >= 1.0.
"""
from __future__ import annotations

import time

from bench import arms, environment, machine, reporting
from onegpu.formatting import markdown_table, ratio

TARGET = 1.0


def plain_run(model, tok, dsd, cfg, verbose: bool) -> dict:
    from transformers import Trainer, TrainerCallback
    from transformers.integrations import MLflowCallback

    from onegpu.config import resolve
    from onegpu.training.backends import hf_trainer
    from onegpu.training.objectives import collator_for, model_inputs

    class Stamps(TrainerCallback):
        def __init__(self):
            self.t: list[float] = []

        def on_train_begin(self, *a, **k):
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            self.t.append(time.perf_counter())

    import tempfile
    resolved = resolve(cfg)
    out = tempfile.mkdtemp(prefix="plain-trainer-")
    arms.release_memory()
    t0 = time.perf_counter()
    args = hf_trainer.training_arguments(cfg, out)
    args.report_to = ["mlflow"]
    train_ds = model_inputs(dsd, cfg.model.task)["train"]
    trainer = Trainer(model=model, args=args, train_dataset=train_ds,
                      data_collator=collator_for(cfg.model.task, tok), processing_class=tok)
    assert any(isinstance(c, MLflowCallback) for c in trainer.callback_handler.callbacks)
    stamps = Stamps()
    trainer.add_callback(stamps)
    with arms.quiet(verbose):
        trainer.train()
    wall = time.perf_counter() - t0
    times = [b - a for a, b in zip([stamps.t0] + stamps.t[:-1], stamps.t)]
    eff = resolved.effective_batch_size
    rows = [{"step": i, "step_time_s": t, "samples": eff} for i, t in enumerate(times, 1)]
    res = arms.steady(rows)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    res["params_logged"] = len({**model.config.to_dict(), **args.to_dict()})
    res.update(total_s=wall, wall_s=wall, first_loss=logs[0]["loss"] if logs else None,
               first_grad_norm=logs[0].get("grad_norm") if logs else None, steps=len(times))
    return res


def our_extras(cfg, labels, path, tok, dsd) -> dict:
    """Direct timings of the work ours does and plain does not: the activation probe (once per run) and
    the per-step measurement (RSS peak reset and read)."""
    from onegpu.measure import memory
    from onegpu.training.objectives import collator_for, loss_for, model_inputs
    from onegpu.training.objectives.batches import probe_batch
    model = arms.pretrained_model(cfg, labels, path)
    ds = model_inputs(dsd, cfg.model.task)["train"]
    batch = probe_batch(ds, collator_for(cfg.model.task, tok), cfg.train.per_device_train_batch_size)
    memory.activation_bytes(model, batch, loss_for(cfg.model.task))  # warm
    t0 = time.perf_counter()
    memory.activation_bytes(model, batch, loss_for(cfg.model.task))
    probe = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(200):
        memory.synchronize("cpu")
        memory.peak_bytes("cpu")
        memory.reset_peak("cpu")
    per_step = (time.perf_counter() - t0) / 200
    return {"probe_s": probe, "per_step_measure_s": per_step}


# -- the arms ----------------------------------------------------------------------------------------

def _stores(tmp):
    """Ours: the script's store (``tracking.connect``); plain: a SQLite store of its own, which HF's
    MLflowCallback reads from ``MLFLOW_TRACKING_URI``."""
    import os

    from mlflow import MlflowClient

    from onegpu import tracking
    tracker = tracking.connect("bench-ours")           # <tmp>/mlflow.db (MLFLOW_TRACKING_URI unset here)
    peer_uri = f"sqlite:///{tmp / 'peer.db'}"
    MlflowClient(peer_uri).create_experiment("bench-peer", artifact_location=(tmp / "peer-artifacts").as_uri())
    os.environ["MLFLOW_TRACKING_URI"] = peer_uri       # read by HF's MLflowCallback (plain arm only)
    os.environ["MLFLOW_EXPERIMENT_NAME"] = "bench-peer"
    return tracker


def measure(args, tmp) -> tuple[dict, dict, object]:
    """The paired runs (ours and plain, the order alternating) and the directly timed extras of ours.
    Returns ``({arm: [results]}, extras, cfg)``."""
    tracker = _stores(tmp)
    cfg = arms.make_cfg(args, micro=args.micro, accum=args.accum)
    dsd, labels, tok, path = arms.data(cfg)
    eff = args.micro * args.accum
    if len(dsd["train"]) < eff * args.steps:
        print(f"note: {len(dsd['train'])} rows < {eff} x {args.steps}: the epoch ends with a partial step")
    arms.warm_up(args)

    def one(arm):
        model = arms.pretrained_model(cfg, labels, path)
        if arm == "ours":
            r = arms.stage_run(tracker, model, tok, dsd, cfg, args.verbose)
            r.update(first_loss=r["rows"][0]["loss"], first_grad_norm=r["rows"][0]["grad_norm"],
                     samples=r["summary"]["train_samples"])
        else:
            r = plain_run(model, tok, dsd, cfg, args.verbose)
            r["samples"] = eff * r["steps"]
        r["e2e_samples_per_second"] = r["samples"] / r["total_s"]
        r["outside_steps_s"] = r["total_s"] - sum(r["step_times_s"])
        return r

    runs = arms.run_reps(args, lambda rep: arms.rotated(["ours", "plain"], rep), one, lambda res: (
        f"{res['e2e_samples_per_second']:.2f} samples/s end to end, median step {res['median_step_s']:.4f} s, "
        f"wall {res['total_s']:.1f} s, first loss {res['first_loss']:.4f}"))
    return runs, our_extras(cfg, labels, path, tok, dsd), cfg


def summarize(runs: dict) -> dict:
    """Medians per arm (end-to-end and steady samples/s, step time, wall, time outside the steps) and
    the ratios ours/plain."""
    med = {k: {a: reporting.median(r[k] for r in runs[a]) for a in runs}
           for k in ("e2e_samples_per_second", "samples_per_second", "median_step_s", "total_s", "outside_steps_s")}
    ratio = med["e2e_samples_per_second"]["ours"] / med["e2e_samples_per_second"]["plain"]
    return {**med, "ratio": ratio, "met": ratio >= TARGET,
            "ratio_steady": med["samples_per_second"]["ours"] / med["samples_per_second"]["plain"],
            "pairs": [o["median_step_s"] / p["median_step_s"] for o, p in zip(runs["ours"], runs["plain"])]}


# -- the report --------------------------------------------------------------------------------------

NAMES = {"ours": "onegpu train stage (ExactLossTrainer, step callbacks, batched MLflow, system metrics)",
         "plain": 'plain transformers.Trainer, report_to=["mlflow"], logging_steps=1'}


def _table(runs: dict, s: dict) -> str:
    rows = [[NAMES[a], ", ".join(f"{r['e2e_samples_per_second']:.2f}" for r in runs[a]),
             f"{s['e2e_samples_per_second'][a]:.2f}", f"{s['samples_per_second'][a]:.2f}",
             f"{s['median_step_s'][a]:.4f} s", f"{s['total_s'][a]:.1f} s", f"{s['outside_steps_s'][a]:.2f} s",
             f"{runs[a][0]['first_loss']:.4f}", f"{runs[a][0]['first_grad_norm']:.3f}"] for a in ("plain", "ours")]
    return markdown_table(["arm", "end-to-end samples/s per rep", "median", "steady samples/s (steps 2..N)",
                           "median step time", "wall per run", "of which outside the steps", "step-1 loss (logged)",
                           "step-1 grad_norm"], rows)


def _extras_line(extras: dict, wall: float, n_ours: int, n_plain: int) -> str:
    return (f"- Work ours does that plain does not, timed directly: the activation probe (one extra forward pass "
            f"of a micro-batch at train begin) {extras['probe_s']:.3f} s per run = "
            f"{100 * extras['probe_s'] / wall:.1f}% of a {wall:.1f} s run; the per-step measurement (device sync, "
            f"RSS-peak read and reset) {extras['per_step_measure_s'] * 1e6:.0f} us per optimizer step. Plain logs "
            f"every step's metrics asynchronously (a background thread) and {n_plain} params at start; ours "
            f"batches metrics, logs {n_ours} params and runs MLflow's system-metrics monitor (a thread sampling "
            "every 5 s).")


def _pairs_line(s: dict, extras: dict) -> str:
    pairs, text = s["pairs"], ", ".join(f"{x:.3f}" for x in s["pairs"])
    if s["ratio_steady"] >= 1:
        return f"- Per pair, ours/plain median step time: {text}."
    both_sides = min(pairs) < 1 < max(pairs)
    return (f"- In steady state (steps 2..N) ours is {100 * (1 - s['ratio_steady']):.1f}% slower. Per pair, "
            f"ours/plain median step time: {text}"
            + (": on both sides of 1, so this is within the run-to-run variation of this machine, not a "
               "consistent cost." if both_sides else ": ours slower in every pair.")
            + f" The per-step work ours adds, timed directly, is small (measurement "
            f"{extras['per_step_measure_s'] * 1e6:.0f} us; the batched writer's add tens of us, its flush every "
            "~28 steps a few ms: see tracking_overhead)" + ("." if both_sides else ", less than the difference: it "
                                                             "is not explained here."))


def _loss_line(args, runs: dict) -> list[str]:
    l0, l1 = runs["plain"][0]["first_loss"], runs["ours"][0]["first_loss"]
    if not (args.accum > 1 and l1 and abs(l0 / l1 - args.accum) < 0.05 * args.accum):
        return []
    return [f"- Not the same numbers: plain Trainer's step-1 loss ({l0:.4f}) and grad_norm are {ratio(l0 / l1)} ours "
            f"({l1:.4f}, ~ln 5 for a new 5-way head) = the accumulation count. BertForSequenceClassification's "
            "forward takes `**kwargs`, so Trainer passes `num_items_in_batch` and does not divide by "
            "`gradient_accumulation_steps`, but the model's mean loss ignores it: plain sums the micro-batch "
            "means (its gradient too, which changes gradient clipping). onegpu's exact loss is the mean over the "
            "effective batch. The work per step is the same."]


def report_lines(args, runs: dict, extras: dict, s: dict, n_ours: int) -> list[str]:
    wall, outside = s["total_s"]["ours"], s["outside_steps_s"]
    lines = [
        f"`bench/vs_trainer.py`: MiniLM-L6 (pretrained), {args.micro} x {args.accum} per optimizer step, "
        f"max_length {args.max_length}, {args.steps} optimizer steps per run, {args.reps} repetitions "
        "(order alternating), same seed, data, collator and TrainingArguments values.", "", _table(runs, s), "",
        f"- Ratio ours/plain, end-to-end samples/s: **{s['ratio']:.3f}**; steady state (steps 2..N): "
        f"{s['ratio_steady']:.3f}. Target >= {TARGET:.1f}: **{'met' if s['met'] else 'NOT met'}**.",
        _extras_line(extras, wall, n_ours, runs["plain"][0]["params_logged"]), _pairs_line(s, extras),
        f"- Outside the optimizer steps (building the trainer, MLflow setup and teardown, the probe, data "
        f"loader start, end of training): ours {outside['ours']:.2f} s, plain {outside['plain']:.2f} s per run; "
        "with few steps this decides the end-to-end ratio, with many the steady-state ratio does.",
        *_loss_line(args, runs)]
    if not s["met"]:
        lines.append(f"- The target is not met here: ours is {100 * (1 - s['ratio']):.1f}% slower end to end. "
                     f"The probe alone accounts for about {100 * extras['probe_s'] / wall:.1f}% of the run; "
                     f"in steady state the ratio is {s['ratio_steady']:.3f}"
                     + (" (within the run-to-run noise of this shared 2-core machine)."
                        if abs(1 - s["ratio_steady"]) < 0.02 else "."))
    return lines + [f"- {machine.load_note(runs['ours'] + runs['plain'])}"]


def main() -> None:
    args = environment.parser(__doc__.splitlines()[0], reps=5, steps=12, rows=200, micro=8, accum=2).parse_args()
    tmp = environment.setup()
    runs, extras, cfg = measure(args, tmp)
    s = summarize(runs)
    from onegpu.config import flatten
    payload = {"target_ratio_min": TARGET, "ratio_e2e": s["ratio"], "ratio_steady": s["ratio_steady"],
               "target_met": s["met"], "e2e_samples_per_second": s["e2e_samples_per_second"],
               "steady_samples_per_second": s["samples_per_second"], "median_step_s": s["median_step_s"],
               "wall_s": s["total_s"], "extras": extras, "runs": arms.without_rows(runs)}
    reporting.report("vs_trainer", args, "onegpu train stage against plain HF Trainer + MLflow",
                  report_lines(args, runs, extras, s, len(flatten(cfg.to_dict())) + 4), payload)


if __name__ == "__main__":
    main()
