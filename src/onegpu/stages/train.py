"""``onegpu train``: fine-tune on data/processed -> models/, metrics/train.json, plots/train_steps.csv.

Opens the training run (one per training configuration) and ends it when the stage ends: SCHEDULED
(trained; its evaluation is still to come), or FAILED/KILLED on an error or a stop. ``evaluate``
re-opens the same run, logs into it and ends it FINISHED; the run id is kept in ``models/mlflow_run.json``.
No run is RUNNING unless a process writes to it.
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
# metrics/train.json (`dvc exp show`, `dvc metrics diff`): these headline figures only, so a sweep's
# table fits a terminal next to the params that vary. Everything else (runtime, memory breakdown, FLOP/s,
# MFU, the split `auto` chose as resolved.* params, per-step series) is in the MLflow run.
HEADLINE = ("train_loss", "train_samples_per_second", "train_mem_peak_bytes")


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
    _other_checkpoints(tracker, ckpt_dir, key, cfg, stats["fingerprint"], announce=True)
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
    # Ends SCHEDULED, not FINISHED: the configuration's run is finished once evaluate has logged into it.
    with tracker.guard(run_id, finish="SCHEDULED", context=lambda: {"error.step": str(progress["step"] + 1)}), \
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
        # Training switches the KV cache off (Trainer and checkpointing); the saved model gets it back.
        saved_config = {"use_cache": model.config.use_cache} if hasattr(model.config, "use_cache") else {}

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
        from onegpu.training.callbacks import step_metrics
        for row in (resume[1]["rows"] if resume else []):  # the stopped run's steps, so this one is whole
            sink(step_metrics(row), row["step"])
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
        speed, speed_params, speed_tags = _speed(model, summary, cfg, device, tags["device"], steps.tokens_sq())
        summary.update(speed)
        tracker.log_params(run_id, speed_params)
        tracker.set_tags(run_id, {**speed_tags, **_step_tags(steps, resolved.effective_batch_size)})
        tracker.log_metrics(run_id, {k: v for k, v in summary.items()
                                     if k not in ("train_steps", "train_samples", "train_tokens")},
                            step=0)  # step 0, like eval_*: MLflow draws a bar, not a lone dot

        # Outputs: written aside, then moved into place.
        paths.MODEL_DIR.parent.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=paths.MODEL_DIR.parent, prefix=".model-")
        from transformers.utils import logging as hf_logging
        hf_logging.disable_progress_bar()  # no "Writing model shards" bar between the progress lines
        _save_model(model, tmp, saved_config)
        tokenizer.save_pretrained(tmp)
        shutil.rmtree(paths.MODEL_DIR, ignore_errors=True)
        shutil.move(tmp, paths.MODEL_DIR)
        _write_steps(steps.rows)
        paths.write_json_atomic(paths.TRAIN_METRICS, {k: summary[k] for k in HEADLINE if k in summary})
        paths.write_json_atomic(paths.RUN_FILE, {"run_id": run_id, "experiment_id": tracker.experiment_id,
                                                 "equivalence_key": key})
    shutil.rmtree(ckpt_dir, ignore_errors=True)  # finished: nothing left to resume
    _other_checkpoints(tracker, ckpt_dir, key, cfg, stats["fingerprint"], finished=True)
    print(f"train: {summary.get('train_steps', 0)} optimizer steps of {resolved.effective_batch_size} examples "
          f"({resolved.per_device_train_batch_size} x {resolved.gradient_accumulation_steps}), "
          f"train_loss {summary.get('train_loss', float('nan')):.4f}, {summary.get('train_runtime', 0):.1f} s, "
          f"{_peak_text(summary.get('train_mem_peak_bytes', 0), device, budget if auto else None)} "
          f"on {tags['device']}; MLflow run {run_id}")
    return summary


_BUDGET_CPU = ("; on a CPU the budget covers the training state: params, grads, optimizer states and "
               "activations, not the whole process")


def _peak_text(peak: int, device: str, budget: int | None) -> str:
    """The peak memory for the closing line, saying what it measures. On a CPU it is the process RSS,
    which holds the Python runtime, the libraries and the data besides the training state, so it
    exceeds an ``auto`` budget (which covers the probed training state only)."""
    if device.startswith("cuda"):
        return f"peak {peak / 2**20:.0f} MiB allocated"
    text = f"peak {peak / 2**20:.0f} MiB process RSS"
    if budget is not None:
        text += (f" (the auto budget, {budget / 2**30:.2f} GiB, covers the probed training state only; RSS "
                 "also holds the Python runtime, libraries and data)")
    return text


def _checkpoints(cfg: Config, fingerprint: str):
    """This configuration's checkpoint folder and the checkpoint to resume from, if any."""
    from onegpu.config import run_config_hash
    ckpt_dir = paths.checkpoint_dir(run_config_hash(cfg, fingerprint))
    from onegpu.training.checkpoint import latest_checkpoint
    return ckpt_dir, latest_checkpoint(ckpt_dir)


def _other_checkpoints(tracker, ckpt_dir, key: str, cfg: Config, fingerprint: str, announce: bool = False,
                       finished: bool = False) -> None:
    """Say which checkpoints of other configurations this run does not use (``announce``) and prune those
    nothing can resume: at the start the ones whose run is deleted or finished, after a finished training
    also the stopped runs of the same equivalence key. The rule: :func:`onegpu.training.checkpoint.
    review_other_checkpoints`. Never stops training: a store or disk error skips it."""
    from onegpu.training.checkpoint import review_other_checkpoints
    try:
        items = review_other_checkpoints(ckpt_dir, key, flatten(cfg.to_dict()), fingerprint, tracker.find_run)
    except Exception:
        return
    for item in items:
        if item["action"] == "prune" or (finished and item["action"] == "superseded"):
            shutil.rmtree(item["folder"], ignore_errors=True)
            msg = item["message"] if item["action"] == "prune" else (
                f"removed the checkpoint of stopped MLflow run {item['run_id']} at optimizer step {item['step']} "
                f"({item['folder']}): this run finished the same training (equivalence key {key})")
            print(f"train: {msg}", flush=True)
        elif announce and item["message"]:
            print(f"train: {item['message']}", flush=True)


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
          f"{cfg.train.effective_batch_size} (budget {budget / 2**30:.2f} GiB, longest training rows"
          f"{_BUDGET_CPU if not str(device).startswith('cuda') else ''})\n{table}")
    tracker.log_dict(run_id, {"budget_bytes": budget, "probes": [p.as_row() for p in probes]},
                     "auto_micro_batch.json")
    tracker.log_text(run_id, table + "\n", "auto_micro_batch.md")
    return micro


def _save_model(model, directory, config_values: dict) -> None:
    """``save_pretrained`` (safetensors) with ``config_values`` (e.g. ``use_cache`` as the model had it
    before training switched it off) set back on the model's config first."""
    for k, v in config_values.items():
        setattr(model.config, k, v)
    model.save_pretrained(directory)


def _step_tags(steps, effective_batch: int) -> dict:
    """Tags from the recorder: ``onegpu.machine``, the training window (``onegpu.train_start_ms`` and
    ``onegpu.train_end_ms``, milliseconds since the epoch, first step's start to last step's end in this
    process) and ``onegpu.partial_steps`` when an optimizer step saw fewer examples than the effective batch."""
    import hashlib
    import json
    import platform
    # Which machine trained (a hash of the host name, not the name): only runs on one machine compete.
    out = {"onegpu.machine": hashlib.sha256(platform.node().encode()).hexdigest()[:12]}
    if steps.window_start is not None and steps.window_end is not None:
        out["onegpu.train_start_ms"] = str(int(steps.window_start * 1000))
        out["onegpu.train_end_ms"] = str(int(steps.window_end * 1000))
    partial = steps.partial_steps(effective_batch)
    if partial:
        out["onegpu.partial_steps"] = json.dumps(partial)
        for p in partial:
            print(f"train: optimizer step {p['step']} saw {p['examples']} of {effective_batch} examples "
                  "(the epoch's last rows); its loss is the mean over those")
    return out


def _speed(model, summary: dict, cfg: Config, device: str, device_name: str,
           tokens_sq: int | None = None) -> tuple[dict, dict, dict]:
    """``train_flops_per_second`` (model FLOPs, :mod:`onegpu.flops`) and ``train_mfu`` against the
    device's peak in the matmul dtype; ``model_flops_per_token`` and ``device_peak_flops`` with them.

    Returns ``(metrics, params, tags)``: params name the peak's source and, for a measured peak, its
    cache file; with no trustworthy peak ``train_mfu`` is left out and the tag
    ``train_mfu.unknown_reason`` says why."""
    from onegpu import flops
    if not summary.get("train_samples") or not summary.get("train_runtime"):
        return {}, {}, {}
    total = flops.train_flops(model, summary["train_samples"], summary["train_tokens"],
                              tokens_sq)
    achieved = total / summary["train_runtime"]
    m = flops.mfu(achieved, device_name, flops.matmul_dtype(cfg.train.mixed_precision), device)
    metrics = {"train_flops_per_second": achieved, "model_flops_per_token": total / summary["train_tokens"],
               "device_peak_flops": m["peak"]}
    params = {"device_peak_flops.source": m["source"]}
    if m["source"] == "measured":
        params["device_peak_flops.cache"] = flops.display_path(flops.cache_file())
    tags = {}
    if m["mfu"] is None:
        tags["train_mfu.unknown_reason"] = m["unknown_reason"]
        print(f"train: {m['unknown_reason']}")
    else:
        metrics["train_mfu"] = m["mfu"]
    return metrics, params, tags


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
