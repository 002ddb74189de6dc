"""What a training run says about itself in MLflow: its name from its settings (:func:`config_name`, tag
:data:`CONFIG_TAG`), the results the recorder measured (:func:`log_results`: out-of-memory events, summary,
memory, speed), the recorder's tags (:func:`step_tags`) and the runs table's tags in people's units
(:func:`table_tags`). Called by :mod:`onegpu.training.tracked_run` with its run handle."""
from __future__ import annotations

import hashlib
import json
import platform

from onegpu.config import Config, TrainConfig
from onegpu.formatting import size
from onegpu.measure import flops, memory
from onegpu.training.parallel import distributed

CONFIG_TAG = "config"  # the run's settings in a few characters (config_name), also on DVC-named runs

# Tags with the run's costs in people's units, for MLflow's runs table (it prints metrics as raw numbers:
# 1572425728 bytes, nine-digit floats): memory, speed and outside_load.
TABLE_TAGS = ("memory", "speed", "outside_load")


def config_name(cfg: Config) -> str:
    """The training settings as a run name: the split (``bs<micro>x<accumulation>``, ``bsauto-eff<N>``
    for ``auto``, ``x<N>proc`` with several processes, ``-<M>machines`` over several machines), the precision,
    then the knobs that are on or not at their default: ``fsdp``, ``ckpt``, ``lora-r<r>``, ``padfree``,
    ``packing``, ``compile``, another backend or optimizer. E.g. ``bs4x4-fp32-ckpt``,
    ``bs16x1-bf16-lora-r8-accelerate``, ``bs8x2x2proc-fp32-fsdp-accelerate``. The train stage names a run
    so when DVC gives no experiment name (``dvc repro``)."""
    t = cfg.train
    micro = t.per_device_train_batch_size
    head = f"bsauto-eff{t.effective_batch_size}" if micro == "auto" else f"bs{micro}x{t.gradient_accumulation_steps}"
    procs = f"x{t.num_processes}proc" + (f"-{t.num_machines}machines" if t.num_machines > 1 else "")
    parts = [head + (procs if t.num_processes > 1 else ""),
             "bf16" if t.bf16 else "fp16" if t.fp16 else "tf32" if t.tf32 else "fp32"]
    lora = cfg.model.lora_adapters
    knobs = {"fsdp": t.fsdp.enabled, "ckpt": t.gradient_checkpointing,
             f"lora-r{lora.r if lora else 0}": lora is not None, "padfree": cfg.data.padding_free,
             "packing": cfg.data.packing, "compile": t.torch_compile,
             t.backend: t.backend != TrainConfig.backend, t.optim: t.optim != TrainConfig.optim}
    return "-".join(parts + [name for name, on in knobs.items() if on])


def log_results(plan, tracker, run_id: str, buffer, model, steps) -> dict:
    """Log what the recorder ``steps`` (a :class:`onegpu.training.record.recorder.StepRecorder`) measured of
    ``plan``'s training (a :class:`onegpu.training.session.TrainPlan` with its layout) into ``run_id``:
    out-of-memory events (per-step metric ``oom_retry_micro_batch`` through ``buffer``, then flushed;
    tags), the summary and memory (metrics at step 0), speed (``flops.speed_metrics``: metrics, params
    and tags), the recorder's and the runs table's tags. Returns the summary metrics (seconds, bytes,
    samples/s, FLOP/s)."""
    for ev in steps.events:  # out-of-memory recoveries: the split changed, the result did not
        buffer.add({"oom_retry_micro_batch": ev["micro_batch"]}, ev["step"])
    buffer.flush()
    if steps.events:
        tracker.set_tags(run_id, {"oom_retry.events": json.dumps(steps.events),
                                  "oom_retry.final_split": steps.events[-1]["new"]})
    summary = steps.summary()
    summary.update(steps.memory())
    speed, speed_params, speed_tags = flops.speed_metrics(
        model, summary, plan.cfg.train.num_processes, plan.cfg.train.mixed_precision, plan.device,
        memory.device_name(plan.device), steps.tokens_sq())
    if "train_mfu.unknown_reason" in speed_tags:
        print(f"train: {speed_tags['train_mfu.unknown_reason']}")
    summary.update(speed)
    tracker.log_params(run_id, speed_params)
    tracker.set_tags(run_id, {**speed_tags, **step_tags(steps, plan.resolved.effective_batch_size),
                              **table_tags(summary), **validation_tags(steps)})
    tracker.log_metrics(run_id, {k: v for k, v in summary.items()
                                 if k not in ("train_steps", "train_samples", "train_tokens")},
                        step=0)  # step 0, like eval_*: MLflow draws a bar, not a lone dot
    return summary


def validation_tags(steps) -> dict:
    """What validation decided, on the run page: ``onegpu.early_stopping`` (the sentence: at which step and
    why), and with ``train.load_best_model_at_end`` ``onegpu.best_step`` and ``onegpu.best_metric``
    (``eval_loss=0.5123``): the validation point whose weights models/ holds."""
    tags = {"onegpu.early_stopping": steps.stopped_early} if steps.stopped_early else {}
    best = steps.best
    if best is not None:
        tags.update({"onegpu.best_step": str(best["step"]),
                     "onegpu.best_metric": f"{best['metric']}={best['value']:.6g}"})
    return tags


def step_tags(steps, effective_batch: int) -> dict:
    """Tags from the recorder: ``onegpu.machine``, the training window (``onegpu.train_start_ms`` and
    ``onegpu.train_end_ms``, milliseconds since the epoch, first step's start to last step's end in this
    process) and ``onegpu.partial_steps`` when an optimizer step saw fewer examples than the effective batch."""
    # Which machine trained (a hash of the host name, not the name): only runs on one machine compete.
    out = {"onegpu.machine": hashlib.sha256(platform.node().encode()).hexdigest()[:12]}
    if steps.window_start is not None and steps.window_end is not None:
        out["onegpu.train_start_ms"] = str(int(steps.window_start * 1000))
        out["onegpu.train_end_ms"] = str(int(steps.window_end * 1000))
    partial = steps.partial_steps(effective_batch)
    if partial:
        out["onegpu.partial_steps"] = json.dumps(partial)
        for p in partial:  # (every process tags its own run object; one line on the terminal)
            distributed.print_main(f"train: optimizer step {p['step']} saw {p['examples']} of {effective_batch} "
                                   "examples (the epoch's last rows); its loss is the mean over those")
    return out


def table_tags(summary: dict, load: dict | None = None) -> dict[str, str]:
    """``memory`` (``train_mem_peak_bytes`` in MiB/GiB), ``speed`` (``train_samples_per_second``,
    e.g. ``2.53 samples/s``) from the summary, and ``outside_load`` (other processes' share of the CPUs,
    e.g. ``71% of 2 CPUs``) from ``load``; each only when measured."""
    out = {}
    if summary.get("train_mem_peak_bytes") is not None:
        out["memory"] = size(summary["train_mem_peak_bytes"])
    if summary.get("train_samples_per_second") is not None:
        out["speed"] = f"{summary['train_samples_per_second']:.2f} samples/s"
    if load is not None and load.get("share") is not None:
        out["outside_load"] = f"{load['share']:.0%} of {load['cpus']} CPUs" + (
            f" + {load['gpu_processes']} GPU process(es)" if load.get("gpu_processes") else "")
    return out
