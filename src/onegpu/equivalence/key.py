"""The equivalence key: which params define the mathematics of a training run, and their hash.

Two runs with the same key compute the same optimizer steps (up to floating-point summation order):
only the split of the effective batch, checkpointing, the backend and what is observed may differ.
The train stage writes the key as the run's ``equivalence_key`` tag and the resolved batch layout as the
``resolved.*`` params named here; :mod:`onegpu.compare` reads both back.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any

from onegpu.config import Config, Resolved, flatten, out_of_key, resolve

# The MLflow tag holding a training run's key.
KEY_TAG = "equivalence_key"

# MLflow params of the batch layout actually used (:class:`onegpu.config.Resolved`).
RESOLVED_MICRO_BATCH = "resolved.per_device_train_batch_size"
RESOLVED_ACCUMULATION = "resolved.gradient_accumulation_steps"
RESOLVED_EFFECTIVE_BATCH = "resolved.effective_batch_size"
RESOLVED_WORLD_SIZE = "resolved.world_size"


def resolved_params(resolved: Resolved) -> dict[str, int]:
    """The ``resolved.*`` MLflow params of a batch layout (examples per micro-batch, micro-batches per
    optimizer step, examples per optimizer step, processes)."""
    return {RESOLVED_MICRO_BATCH: resolved.per_device_train_batch_size,
            RESOLVED_ACCUMULATION: resolved.gradient_accumulation_steps,
            RESOLVED_EFFECTIVE_BATCH: resolved.effective_batch_size,
            RESOLVED_WORLD_SIZE: resolved.world_size}


# Params that decide only how the work is split or observed, not the mathematics of training, and why:
# declared with each key (onegpu.config's ``knob(..., key=OutOfKey(why))``). Left out of the equivalence key.
NOT_IN_EQUIVALENCE_KEY = out_of_key()

# Values of a param in the key that compute the same training as another value: (param, value) -> the
# value the key uses instead, with the reason. Any other optimizer is a different training (in the key).
SAME_AS_IN_KEY = {
    ("train.optim", "adamw_torch_fused"): ("adamw_torch", "the fused AdamW kernel computes the same update "
                                                          "as the for-each one (other rounding order)"),
}


# Instruction-data keys at their defaults (off): left out of the key and of the run-config hash, so runs
# and checkpoints made before these keys existed keep their keys. On, they are in (another training: loss on
# other tokens; packing puts other examples in each micro-batch and step).
SFT_DEFAULTS = {"data.completion_only_loss": None, "data.assistant_only_loss": False, "data.packing": False,
                "data.padding_free": False}


def _drop_sft_defaults(flat: dict) -> None:
    for k, default in SFT_DEFAULTS.items():
        if k in flat and flat[k] == default:
            flat.pop(k)


def _drop_other_objectives(flat: dict, task: str) -> None:
    """``train.dpo.*`` shape a preference run's loss only, ``train.grpo.*`` a GRPO run's: left out of other runs'
    keys and hashes (so theirs stay what they were before the section existed)."""
    for section, owner in (("train.dpo", "preference"), ("train.grpo", "grpo")):
        if task != owner:
            for k in [k for k in flat if k == section or k.startswith(section + ".")]:
                flat.pop(k)


# The checkpointing granularity at its defaults (today's behaviour): left out of the run-config hash.
_GRANULARITY_DEFAULTS = {"train.gradient_checkpointing_kwargs.use_reentrant": False,
                         "train.gradient_checkpointing_kwargs.every_n_layers": 1,
                         "train.gradient_checkpointing_blocks": "layer"}


MODEL_FROM_CONFIG_KEYS = ("model.n_layer", "model.n_embd", "model.n_head", "model.vocab_size")


def equivalence_fields(cfg: Config, resolved: Resolved, data_fingerprint: str = "") -> dict[str, Any]:
    """The values that define the mathematics of a training run.

    Everything in params.yaml except :data:`NOT_IN_EQUIVALENCE_KEY` (values listed in
    :data:`SAME_AS_IN_KEY` replaced by the value they compute the same as), plus the resolved effective batch
    size and the prepared data's content fingerprint (so two runs on different data files never match); for GRPO's
    ``bnpo`` loss, whose value depends on the split, the resolved micro-batch and accumulation too.
    """
    flat = {k: v for k, v in flatten(cfg.to_dict()).items() if k not in NOT_IN_EQUIVALENCE_KEY}
    # LoRA trains other parameters: model.lora.* are in the key. Off (null or r: 0) adds nothing, so
    # keys of full fine-tuning stay as they were before the knob existed.
    if cfg.model.lora_adapters is None:
        flat = {k: v for k, v in flat.items() if k != "model.lora" and not k.startswith("model.lora.")}
    _drop_sft_defaults(flat)
    _drop_other_objectives(flat, cfg.model.task)
    for k, v in flat.items():
        if v is None or isinstance(v, (str, int, float, bool)):  # scalars; lists (LoRA targets) stay as given
            flat[k] = SAME_AS_IN_KEY.get((k, v), (v,))[0]
    if cfg.model.name_or_path is not None:  # the sizes apply only to a model built from config
        for k in MODEL_FROM_CONFIG_KEYS:
            flat.pop(k, None)
    flat[RESOLVED_EFFECTIVE_BATCH] = resolved.effective_batch_size
    if cfg.model.task == "grpo" and cfg.train.grpo.loss_type == "bnpo":  # TRL's mean of micro-batch token means:
        flat[RESOLVED_MICRO_BATCH] = resolved.per_device_train_batch_size  # another split, another training
        flat[RESOLVED_ACCUMULATION] = resolved.gradient_accumulation_steps
    flat["data.fingerprint"] = data_fingerprint
    return flat


# How the effective batch is split: micro-batch x accumulation x processes (or the batch they multiply to).
SPLIT_KEYS = ("train.per_device_train_batch_size", "train.gradient_accumulation_steps", "train.num_processes",
              "train.effective_batch_size")


def effective_batch(cfg: Config) -> int:
    """Examples per optimizer step as params.yaml sets them: ``train.effective_batch_size``, or (null) micro-batch x
    accumulation x processes (``auto`` needs the former: :func:`onegpu.config.validate`)."""
    t = cfg.train
    return int(t.effective_batch_size) if t.effective_batch_size is not None else resolve(cfg).effective_batch_size


# The keys of where a launch's processes run (accelerate's names), out of the run-config hash.
MACHINE_KEYS = ("train.num_machines", "train.machine_rank", "train.main_process_ip", "train.main_process_port")


def run_config_hash(cfg: Config, data_fingerprint: str = "") -> str:
    """16 hex digits naming one exact training configuration (every param but tracking, evaluation,
    validation, terminal output and where the processes run, plus the data fingerprint): a checkpoint resumes only
    a run with the same hash.

    The split of the effective batch (:data:`SPLIT_KEYS`) is replaced by the effective batch itself: a checkpoint
    resumes with another micro-batch, accumulation and number of processes, the same training (every step takes
    the same examples). Whole weights load anywhere; a sharded checkpoint (``torch.distributed.checkpoint``)
    reshards on load (:func:`onegpu.training.lifecycle.resume.load_sharded_state`). ``train.fsdp`` is out: a
    data-parallel and a sharded run of one training find each other's checkpoints, and each refuses the other's layout
    in one line (:func:`onegpu.training.session.check_resumable`)."""
    # train.num_machines, machine_rank, main_process_*: where the processes run; every machine computes the same hash.
    skip = ("tracking.", "evaluate.", "train.logging_steps", "train.save_steps", "train.eval_",
            "train.load_best_model_at_end", "train.metric_for_best_model", "train.greater_is_better",
            "train.early_stopping_", "train.fsdp.", *MACHINE_KEYS)
    flat = {k: v for k, v in flatten(cfg.to_dict()).items() if not k.startswith(skip)}
    for k in SPLIT_KEYS:  # any split of the same effective batch
        flat.pop(k, None)
    flat["train.effective_batch_size"] = effective_batch(cfg)
    if cfg.model.lora_adapters is None:  # as in the key: checkpoints written before the knob still resume
        flat = {k: v for k, v in flat.items() if k != "model.lora" and not k.startswith("model.lora.")}
    for k, default in _GRANULARITY_DEFAULTS.items():  # the same for the checkpointing granularity
        if flat.get(k) == default:
            flat.pop(k)
    _drop_sft_defaults(flat)
    _drop_other_objectives(flat, cfg.model.task)
    flat["data.fingerprint"] = data_fingerprint
    return hashlib.sha256(json.dumps(flat, sort_keys=True, default=str).encode()).hexdigest()[:16]


def equivalence_key(cfg: Config, resolved: Resolved, data_fingerprint: str = "") -> str:
    """A stable 16-hex-digit hash (SHA-256 of sorted JSON) of :func:`equivalence_fields`."""
    blob = json.dumps(equivalence_fields(cfg, resolved, data_fingerprint), sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
