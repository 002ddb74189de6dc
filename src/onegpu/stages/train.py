"""``onegpu train``: fine-tune on data/processed -> models/, metrics/train.json, plots/train_steps.csv.

Opens the training run (one per training configuration) and leaves it RUNNING for ``evaluate``,
which logs into the same run and finishes it; the run id is kept in ``models/mlflow_run.json``.
"""
from __future__ import annotations

import contextlib
import csv
import os
import shutil
import tempfile

from onegpu import measure, models, paths, tracking
from onegpu.config import Config, equivalence_key, flatten, resolve
from onegpu.errors import ConfigError, DataError, ModelError

# train.backend -> the module with ``train(model, tokenizer, dsd, cfg, resolved, sink) -> (model, StepRecorder)``
BACKENDS = {"trainer": "onegpu.training.hf_trainer", "accelerate": "onegpu.training.accel"}


def _device_checks(cfg: Config):
    import torch
    cuda = torch.cuda.is_available()
    if cfg.train.fp16 and not cuda:
        raise ConfigError("params.yaml: train.fp16: fp16 mixed precision needs a CUDA GPU and none is "
                          "visible; use bf16 (CPU autocast) or neither")
    if cfg.train.bf16 and cuda and not torch.cuda.is_bf16_supported():
        raise ConfigError(f"params.yaml: train.bf16: {torch.cuda.get_device_name(0)} has no bf16 support; "
                          "use fp16 or neither")
    return "cuda:0" if cuda else "cpu"


def _load_processed():
    from datasets import load_from_disk
    if not paths.PROCESSED.is_dir() or not paths.STATS.is_file():
        raise DataError(f"{paths.PROCESSED} or {paths.STATS} is missing: run the prepare stage first (dvc repro)")
    return load_from_disk(str(paths.PROCESSED)), paths.read_json(paths.STATS)


def run(cfg: Config) -> dict:
    device = _device_checks(cfg)
    dsd, stats = _load_processed()
    auto = cfg.train.per_device_train_batch_size == "auto"
    if auto:
        from onegpu import autobatch
        budget = autobatch.budget_bytes(cfg.train.memory_budget_gib, device)  # fails before any work
    # The key depends on the effective batch only, which `auto` keeps fixed: known before the finder runs.
    provisional = resolve(cfg, micro_batch=cfg.train.effective_batch_size if auto else None)
    key = equivalence_key(cfg, provisional, stats["fingerprint"])
    tracker = tracking.connect(cfg.tracking.experiment_name)
    tags = {**tracking.run_context_tags(), "stage": "train", "equivalence_key": key,
            "device": measure.device_name(device), "data.fingerprint": stats["fingerprint"]}
    ckpt_dir, resume = _checkpoints(cfg, stats["fingerprint"])
    if resume:
        tags["onegpu.resumed_from"] = resume[1].get("run_id", "")
        tags["onegpu.resumed_at_step"] = str(resume[1]["step"])
    run_id = tracker.start_run(tracking.run_name(), tags)
    if resume:
        print(f"train: resuming from {resume[0]} (optimizer step {resume[1]['step']} of MLflow run "
              f"{resume[1].get('run_id')}, which was stopped); this run is {run_id}")
        try:
            tracker.set_tags(resume[1]["run_id"], {"onegpu.resumed_by": run_id})
        except Exception:
            pass  # the earlier run may be in another store; the link on this run is what matters
    progress = {"step": 0}

    def sink(metrics: dict, step: int) -> None:
        progress["step"] = step
        buffer.add(metrics, step)

    buffer = tracker.metric_buffer(run_id)
    with tracker.guard(run_id, finish=False, context=lambda: {"error.step": str(progress["step"] + 1)}), \
            _flushed(buffer):
        tracker.log_params(run_id, flatten(cfg.to_dict()))

        import importlib

        from transformers import set_seed
        backend = importlib.import_module(BACKENDS[cfg.train.backend])

        path = models.resolve_model_path(cfg.model.name_or_path)
        task = cfg.model.task
        tokenizer = models.load_tokenizer(str(paths.TOKENIZER) if path is None else path, task)
        set_seed(cfg.train.seed)
        if task == "causal-lm":
            model = models.build_causal_lm(path, tokenizer, cfg.model, cfg.data.max_length, cfg.model.dropout)
        else:
            model = models.build_classifier(path, stats["labels"], cfg.model.dropout)
        if cfg.train.gradient_checkpointing and not models.supports_checkpointing(model):
            raise ModelError(f"train.gradient_checkpointing: {type(model).__name__} does not support "
                             "activation checkpointing; set it to false")

        tracker.set_tags(run_id, models.describe(model))

        micro = None
        if auto and resume and resume[1].get("micro_batch"):
            micro = int(resume[1]["micro_batch"])  # the split the checkpoint was written with
        elif auto:
            micro = _find_micro_batch(model, tokenizer, dsd, cfg, budget, device, tracker, run_id)
        resolved = resolve(cfg, micro_batch=micro)
        tracker.log_params(run_id, {
            "resolved.per_device_train_batch_size": resolved.per_device_train_batch_size,
            "resolved.gradient_accumulation_steps": resolved.gradient_accumulation_steps,
            "resolved.effective_batch_size": resolved.effective_batch_size,
            "resolved.world_size": resolved.world_size})
        # Resumable: checkpoints every train.save_steps and on Ctrl-C/SIGTERM (a clean stop).
        from onegpu.training.interrupt import GracefulStop
        stop = GracefulStop()
        extra = {"checkpoint_dir": ckpt_dir, "stop": stop, "resume": resume,
                 "checkpoint_meta": {"run_id": run_id, "micro_batch": resolved.per_device_train_batch_size}}
        for row in (resume[1]["rows"] if resume else []):  # the stopped run's steps, so this one is whole
            sink({k: v for k, v in row.items() if k not in ("step", "samples", "tokens")}, row["step"])
        with tracker.system_metrics(run_id), stop:
            model, steps = backend.train(model, tokenizer, dsd, cfg, resolved, sink=sink, **extra)
        for ev in steps.events:  # out-of-memory recoveries: the split changed, the result did not
            buffer.add({"oom_retry_micro_batch": ev["micro_batch"]}, ev["step"])
        buffer.flush()
        if steps.events:
            import json
            tracker.set_tags(run_id, {"oom_retry.events": json.dumps(steps.events),
                                      "oom_retry.final_split": steps.events[-1]["new"]})
        summary = steps.summary()
        summary.update(steps.memory())
        summary.update(_speed(model, summary, cfg, device, tags["device"]))
        tracker.log_metrics(run_id, {k: v for k, v in summary.items()
                                     if k not in ("train_steps", "train_samples", "train_tokens")},
                            step=0)  # step 0, like eval_*: MLflow draws a bar, not a lone dot

        # Outputs: written aside, then moved into place.
        paths.MODEL_DIR.parent.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=paths.MODEL_DIR.parent, prefix=".model-")
        model.save_pretrained(tmp)  # safetensors
        tokenizer.save_pretrained(tmp)
        shutil.rmtree(paths.MODEL_DIR, ignore_errors=True)
        shutil.move(tmp, paths.MODEL_DIR)
        _write_steps(steps.rows)
        paths.write_json_atomic(paths.TRAIN_METRICS, {
            **{k: v for k, v in summary.items()},
            "effective_batch_size": resolved.effective_batch_size,
            "per_device_train_batch_size": resolved.per_device_train_batch_size,
            "gradient_accumulation_steps": resolved.gradient_accumulation_steps})
        paths.write_json_atomic(paths.RUN_FILE, {"run_id": run_id, "experiment_id": tracker.experiment_id,
                                                 "equivalence_key": key})
    shutil.rmtree(ckpt_dir, ignore_errors=True)  # finished: nothing left to resume
    print(f"train: {summary.get('train_steps', 0)} optimizer steps of {resolved.effective_batch_size} examples "
          f"({resolved.per_device_train_batch_size} x {resolved.gradient_accumulation_steps}), "
          f"train_loss {summary.get('train_loss', float('nan')):.4f}, {summary.get('train_runtime', 0):.1f} s, "
          f"peak {summary.get('train_mem_peak_bytes', 0) / 2**20:.0f} MiB on {tags['device']}; MLflow run {run_id}")
    return summary


def _checkpoints(cfg: Config, fingerprint: str):
    """This configuration's checkpoint folder and the checkpoint to resume from, if any."""
    from onegpu.config import run_config_hash
    ckpt_dir = paths.checkpoint_dir(run_config_hash(cfg, fingerprint))
    from onegpu.training.checkpoint import latest_checkpoint
    return ckpt_dir, latest_checkpoint(ckpt_dir)


@contextlib.contextmanager
def _flushed(buffer):
    """Write buffered step metrics whatever happens: a failed or stopped run keeps every step it logged."""
    try:
        yield
    finally:
        try:
            buffer.flush()
        except Exception:
            pass


def _find_micro_batch(model, tokenizer, dsd, cfg: Config, budget: int, device: str, tracker, run_id: str) -> int:
    """Run the ``auto`` finder (:mod:`onegpu.autobatch`); print and log its probes."""
    from onegpu import autobatch
    from onegpu.training.hf_trainer import collator_for, model_inputs
    from onegpu.training.loss import loss_for
    task = cfg.model.task
    model.to(device)
    if cfg.train.gradient_checkpointing:
        models.enable_checkpointing(model)
    train_rows = model_inputs(dsd, task)["train"]
    if "length" in dsd["train"].column_names:
        train_rows = train_rows.add_column("length", dsd["train"]["length"])
    micro, probes = autobatch.find_micro_batch(
        model, train_rows, collator_for(task, tokenizer), loss_for(task), cfg.train.effective_batch_size,
        budget, cfg.train.optim, device)
    table = autobatch.format_probes(probes)
    print(f"auto micro-batch: {micro} x {cfg.train.effective_batch_size // micro} accumulation = "
          f"{cfg.train.effective_batch_size} (budget {budget / 2**30:.2f} GiB, longest training rows)\n{table}")
    tracker.log_dict(run_id, {"budget_bytes": budget, "probes": [p.as_row() for p in probes]},
                     "auto_micro_batch.json")
    tracker.log_text(run_id, table + "\n", "auto_micro_batch.md")
    return micro


def _speed(model, summary: dict, cfg: Config, device: str, device_name: str) -> dict:
    """``train_flops_per_second`` (model FLOPs, :mod:`onegpu.flops`) and ``train_mfu`` against the
    device's peak in the matmul dtype; ``model_flops_per_token`` and ``device_peak_flops`` with them."""
    from onegpu import flops
    if not summary.get("train_samples"):
        return {}
    per_token = flops.flops_per_token(model, summary["train_tokens"] / summary["train_samples"])
    achieved = per_token * summary["train_tokens_per_second"]
    peak, _source = flops.device_peak(device_name, flops.matmul_dtype(cfg.train.bf16, cfg.train.fp16), device)
    return {"train_flops_per_second": achieved, "train_mfu": achieved / peak,
            "model_flops_per_token": per_token, "device_peak_flops": peak}


def _write_steps(rows: list[dict]) -> None:
    """plots/train_steps.csv: one row per optimizer step (the DVC plot of the loss curve)."""
    cols = ["step", "loss", "grad_norm", "learning_rate", "step_time_s", "samples_per_second",
            "tokens_per_second", "mem_peak_bytes"]
    paths.STEP_PLOT.parent.mkdir(parents=True, exist_ok=True)
    tmp = paths.STEP_PLOT.with_suffix(".tmp")
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    os.replace(tmp, paths.STEP_PLOT)
