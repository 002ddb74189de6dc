"""params.yaml: the typed schema, loading, validation and the equivalence key.

Every stage calls :func:`load` first, so a typo, a wrong type or an out-of-range value stops the stage
with one message naming the key before any data is read. Keys in ``train`` use the names of
``transformers.TrainingArguments`` where one exists.

This module imports only the standard library and OmegaConf, so validation errors come back at once.
"""
from __future__ import annotations

import difflib
import hashlib
import json
import math
import os
from pathlib import Path
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Optional

from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from onegpu.errors import ConfigError

PACKAGED_MODEL = "packaged:all-MiniLM-L6-v2"
PACKAGED_DATA = "bbcnews"

TASKS = ("sequence-classification", "causal-lm")
BACKENDS = ("trainer", "accelerate")
# transformers.SchedulerType values (transformers/trainer_utils.py).
LR_SCHEDULERS = (
    "linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
    "inverse_sqrt", "reduce_lr_on_plateau",
)  # cosine_with_min_lr and warmup_stable_decay need extra kwargs that params.yaml does not carry
# The subset of transformers.training_args.OptimizerNames that needs no extra package.
OPTIMIZERS = ("adamw_torch", "adamw_torch_fused", "adafactor", "sgd", "adagrad", "rmsprop")


@dataclass
class DataConfig:
    source: str = PACKAGED_DATA          # "bbcnews" (packaged corpus), a .csv/.jsonl file or a <label>/*.txt dir
    text_column: str = "text"
    label_column: str = "label"
    max_length: int = 64                  # tokens per example after truncation
    validation_size: float = 0.1          # share of the de-duplicated rows
    test_size: float = 0.2
    max_train_samples: Optional[int] = None   # cap on training examples (null = all)
    max_eval_samples: Optional[int] = None    # cap on validation and test examples (null = all)
    seed: int = 42                        # split and subsampling seed


@dataclass
class ModelConfig:
    task: str = "sequence-classification"
    name_or_path: Optional[str] = PACKAGED_MODEL
    dropout: Optional[float] = None       # null keeps the model's own; a number overrides every dropout
    # causal-lm with name_or_path null: a GPT-2-style model built from these sizes, and a byte-level
    # BPE tokenizer of vocab_size trained by prepare on the training split. Context = data.max_length.
    n_layer: int = 4
    n_embd: int = 128
    n_head: int = 4
    vocab_size: int = 4096


@dataclass
class TrainConfig:
    backend: str = "trainer"
    per_device_train_batch_size: Any = 8  # micro-batch size: an int, or "auto" (needs effective_batch_size)
    gradient_accumulation_steps: int = 1  # micro-batches per optimizer step
    effective_batch_size: Optional[int] = None  # null = micro x accumulation x processes
    memory_budget_gib: Optional[float] = None  # for "auto": null = free device memory (CUDA); required on CPU
    oom_retry: bool = True                # CUDA out-of-memory in a step: halve the micro-batch, redo the step
    gradient_checkpointing: bool = False  # activation checkpointing
    learning_rate: float = 5e-5
    num_train_epochs: float = 1.0
    max_steps: int = -1                   # optimizer steps; -1 = from num_train_epochs
    warmup_ratio: float = 0.0
    lr_scheduler_type: str = "linear"
    weight_decay: float = 0.0
    optim: str = "adamw_torch"
    max_grad_norm: float = 1.0
    seed: int = 42
    bf16: bool = False
    fp16: bool = False
    logging_steps: int = 10               # terminal progress every N optimizer steps (MLflow gets every step)
    save_steps: Optional[int] = None      # resumable checkpoint every N optimizer steps; null = on interrupt only
    dataloader_num_workers: int = 0


@dataclass
class EvaluateConfig:
    per_device_eval_batch_size: int = 64


@dataclass
class TrackingConfig:
    experiment_name: str = "onegpu"


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def to_dict(self) -> dict:
        return asdict(self)


def _allowed_keys(section: str) -> list[str]:
    cls = {f.name: f.type for f in fields(Config)}
    sub = {"data": DataConfig, "model": ModelConfig, "train": TrainConfig,
           "evaluate": EvaluateConfig, "tracking": TrackingConfig}.get(section)
    return [f.name for f in fields(sub)] if sub else list(cls)


def _unknown_key_message(full_key: str) -> str:
    section, _, key = full_key.rpartition(".")
    allowed = _allowed_keys(section) if section else _allowed_keys("")
    hint = difflib.get_close_matches(key, allowed, n=1)
    did = f" Did you mean '{section + '.' if section else ''}{hint[0]}'?" if hint else ""
    where = f"'{section}'" if section else "the top level"
    return (f"unknown key '{full_key}'.{did} Allowed keys in {where}: {', '.join(allowed)}. "
            "(Keys come from params.yaml, e.g. after `dvc exp run -S +section.key=value`.)")


def load(path: str | os.PathLike = "params.yaml", overrides: list[str] | None = None) -> Config:
    """Read, type-check and validate a params file.

    Args:
        path: the YAML file (DVC's ``params.yaml``).
        overrides: DVC-style ``section.key=value`` items applied on top (``onegpu estimate -S``).
    Returns:
        A validated :class:`Config` (defaults filled for keys the file leaves out).
    Raises:
        ConfigError: the file is missing or not YAML, or a key is unknown, of a wrong type or out of
            range; the message names the key and what is allowed.
    """
    if not os.path.exists(path):
        raise ConfigError(f"{path} not found: run onegpu from the project root (where dvc.yaml is)")
    try:
        user = OmegaConf.load(path)
    except Exception as e:  # yaml.YAMLError and friends: report, never a traceback
        raise ConfigError(f"{path} is not valid YAML: {e}") from None
    if user is None or not OmegaConf.is_dict(user) or len(user) == 0:
        raise ConfigError(f"{path} must be a mapping with sections data, model, train, evaluate, tracking")
    raw = OmegaConf.to_container(user)
    for item in overrides or ():
        apply_override(raw, item)
    return from_container(raw, source=str(path) + (" with -S overrides" if overrides else ""))


def apply_override(raw: dict, item: str) -> None:
    """Apply one DVC-style ``-S section.key=value`` (the value parsed as YAML) to ``raw`` in place.

    Raises:
        ConfigError: the item is not ``dotted.key=value``.
    """
    import yaml
    key, sep, value = item.partition("=")
    parts = key.strip().split(".")
    if not sep or len(parts) < 2 or not all(parts):
        raise ConfigError(f"-S {item!r}: expected section.key=value, e.g. train.gradient_accumulation_steps=4")
    node = raw
    for p in parts[:-1]:
        node = node.setdefault(p, {})
    try:
        node[parts[-1]] = yaml.safe_load(value)
    except yaml.YAMLError:
        node[parts[-1]] = value


def from_container(raw: dict, source: str = "params") -> Config:
    """Validate a plain dict shaped like params.yaml (see :func:`load`)."""
    schema = OmegaConf.structured(Config)
    OmegaConf.set_struct(schema, True)
    try:
        merged = OmegaConf.merge(schema, raw)
    except ConfigKeyError as e:
        raise ConfigError(f"{source}: {_unknown_key_message(str(e.full_key))}") from None
    except ValidationError as e:
        if not e.full_key:  # a whole section given as a scalar or a list
            bad = [k for k, v in raw.items() if not isinstance(v, dict)]
            name = bad[0] if bad else "?"
            raise ConfigError(f"{source}: {name}: must be a mapping of keys ({', '.join(_allowed_keys(name))}), "
                              f"got {raw.get(name)!r}") from None
        raise ConfigError(f"{source}: {e.full_key}: {_type_message(e, e.full_key)}") from None
    except OmegaConfBaseException as e:
        raise ConfigError(f"{source}: {getattr(e, 'full_key', '') or ''}: {e.msg if hasattr(e, 'msg') else e}") from None
    cfg: Config = OmegaConf.to_object(merged)
    validate(cfg, source)
    return cfg


def _type_message(e: ValidationError, key: str) -> str:
    section, _, name = key.rpartition(".")
    expected = "a value"
    for cls in (DataConfig, ModelConfig, TrainConfig, EvaluateConfig, TrackingConfig):
        for f in fields(cls):
            if f.name == name:
                expected = {"int": "an integer", "float": "a number", "bool": "true or false",
                            "str": "a string", "Optional[int]": "an integer or null",
                            "Optional[float]": "a number or null",
                            "Optional[str]": "a string or null"}.get(str(f.type), str(f.type))
    value = getattr(e, "value", None)
    if expected in ("a number", "a number or null", "an integer", "an integer or null") and _non_finite(value):
        # DVC's `-S key=.inf` (Hydra's override grammar) writes the *string* '.inf' into params.yaml.
        return f"must be finite (a number{' or null' if 'null' in expected else ''}), got {value!r}"
    return f"expected {expected}, got {value!r}"


def _non_finite(value) -> bool:
    """True for a non-finite float or a string that spells one (``'.inf'``, ``'-Infinity'``, ``'nan'``)."""
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, str):
        word = value.strip().lower().lstrip("+-").lstrip(".")
        return word in ("inf", "infinity", "nan")
    return False


def _fail(source: str, key: str, problem: str) -> None:
    raise ConfigError(f"{source}: {key}: {problem}")


def validate(cfg: Config, source: str = "params") -> None:
    """Check ranges and combinations that types alone cannot. Raises ConfigError naming the key."""
    d, m, t = cfg.data, cfg.model, cfg.train
    for key, value in flatten(cfg.to_dict()).items():
        if isinstance(value, float) and not math.isfinite(value):
            _fail(source, key, f"must be finite (a number), got {value}")
    if d.max_length < 8 or d.max_length > 8192:
        _fail(source, "data.max_length", f"must be an integer from 8 to 8192, got {d.max_length}")
    for k in ("validation_size", "test_size"):
        v = getattr(d, k)
        if not 0.0 < v < 1.0:
            _fail(source, f"data.{k}", f"must be a fraction strictly between 0 and 1, got {v}")
    if d.validation_size + d.test_size >= 0.9:
        _fail(source, "data.test_size", "data.validation_size + data.test_size must leave at least 10% "
              f"for training, got {d.validation_size} + {d.test_size}")
    for k in ("max_train_samples", "max_eval_samples"):
        v = getattr(d, k)
        if v is not None and v < 1:
            _fail(source, f"data.{k}", f"must be a positive integer or null (= all), got {v}")
    for key, seed in (("data.seed", d.seed), ("train.seed", t.seed)):
        if not 0 <= seed < 2**32:
            _fail(source, key, f"must be an integer from 0 to 2**32 - 1 (numpy's range), got {seed}")
    allowed = f"'{PACKAGED_DATA}', a .csv or .jsonl file, or a directory of <label>/*.txt files"
    if not d.source:
        _fail(source, "data.source", f"must be {allowed}")
    if (d.source != PACKAGED_DATA and not d.source.lower().endswith((".csv", ".jsonl"))
            and not Path(d.source).expanduser().is_dir() and Path(d.source).suffix):
        _fail(source, "data.source", f"must be {allowed}, got {d.source!r}")

    if m.task not in TASKS:
        _fail(source, "model.task", f"must be one of {', '.join(TASKS)}, got {m.task!r}")
    for k in ("n_layer", "n_embd", "n_head"):
        if getattr(m, k) < 1:
            _fail(source, f"model.{k}", f"must be a positive integer, got {getattr(m, k)}")
    if m.n_embd % m.n_head:
        _fail(source, "model.n_head", f"must divide model.n_embd ({m.n_embd}), got {m.n_head}")
    if not 256 <= m.vocab_size <= 262144:
        _fail(source, "model.vocab_size", f"must be from 256 (the byte alphabet) to 262144, got {m.vocab_size}")
    if m.name_or_path is None and m.task == "sequence-classification":
        _fail(source, "model.name_or_path", "null (a model built from config) exists only for "
              f"causal-lm; for sequence-classification use '{PACKAGED_MODEL}', a local directory or a hub id")
    if m.dropout is not None and not 0.0 <= m.dropout < 1.0:
        _fail(source, "model.dropout", f"must be null or a probability in [0, 1), got {m.dropout}")

    if t.backend not in BACKENDS:
        _fail(source, "train.backend", f"must be one of {', '.join(BACKENDS)}, got {t.backend!r}")
    mb = t.per_device_train_batch_size
    if mb == "auto":
        if t.effective_batch_size is None:
            _fail(source, "train.effective_batch_size", "is required with per_device_train_batch_size: auto "
                  "(the finder keeps it fixed and chooses how to split it)")
        if t.effective_batch_size < 1:
            _fail(source, "train.effective_batch_size", f"must be a positive integer, got {t.effective_batch_size}")
    elif isinstance(mb, bool) or not isinstance(mb, int) or mb < 1:
        _fail(source, "train.per_device_train_batch_size",
              f"must be a positive integer or 'auto', got {mb!r}")
    if t.gradient_accumulation_steps < 1:
        _fail(source, "train.gradient_accumulation_steps",
              f"must be a positive integer, got {t.gradient_accumulation_steps}")
    if t.effective_batch_size is not None and mb != "auto":
        product = mb * t.gradient_accumulation_steps
        if t.effective_batch_size != product:
            _fail(source, "train.effective_batch_size",
                  f"is {t.effective_batch_size}, but per_device_train_batch_size x "
                  f"gradient_accumulation_steps = {mb} x {t.gradient_accumulation_steps} = {product} "
                  "(one process); make them agree or set effective_batch_size: null")
    if t.memory_budget_gib is not None and t.memory_budget_gib <= 0:
        _fail(source, "train.memory_budget_gib", f"must be a positive number of GiB or null, got {t.memory_budget_gib}")
    if not t.learning_rate > 0:
        _fail(source, "train.learning_rate", f"must be a positive number, got {t.learning_rate}")
    if not t.num_train_epochs > 0:
        _fail(source, "train.num_train_epochs", f"must be a positive number, got {t.num_train_epochs}")
    if t.max_steps == 0 or t.max_steps < -1:
        _fail(source, "train.max_steps", f"must be -1 (use num_train_epochs) or a positive integer, got {t.max_steps}")
    if not 0.0 <= t.warmup_ratio < 1.0:
        _fail(source, "train.warmup_ratio", f"must be in [0, 1), got {t.warmup_ratio}")
    if t.lr_scheduler_type not in LR_SCHEDULERS:
        _fail(source, "train.lr_scheduler_type",
              f"must be one of {', '.join(LR_SCHEDULERS)}, got {t.lr_scheduler_type!r}")
    if t.weight_decay < 0:
        _fail(source, "train.weight_decay", f"must be >= 0, got {t.weight_decay}")
    if t.optim not in OPTIMIZERS:
        _fail(source, "train.optim", f"must be one of {', '.join(OPTIMIZERS)}, got {t.optim!r}")
    if t.max_grad_norm < 0:
        _fail(source, "train.max_grad_norm", f"must be >= 0 (0 = no clipping), got {t.max_grad_norm}")
    if t.bf16 and t.fp16:
        _fail(source, "train.fp16", "train.bf16 and train.fp16 are both true; choose at most one")
    if t.logging_steps < 1:
        _fail(source, "train.logging_steps", f"must be a positive integer, got {t.logging_steps}")
    if t.save_steps is not None and t.save_steps < 1:
        _fail(source, "train.save_steps", f"must be a positive integer or null, got {t.save_steps}")
    if t.dataloader_num_workers < 0:
        _fail(source, "train.dataloader_num_workers", f"must be >= 0, got {t.dataloader_num_workers}")
    if cfg.evaluate.per_device_eval_batch_size < 1:
        _fail(source, "evaluate.per_device_eval_batch_size",
              f"must be a positive integer, got {cfg.evaluate.per_device_eval_batch_size}")
    if not cfg.tracking.experiment_name.strip():
        _fail(source, "tracking.experiment_name", "must be a non-empty string")


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    """Flatten nested dicts with dots: ``{"train": {"seed": 1}}`` -> ``{"train.seed": 1}``."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


@dataclass(frozen=True)
class Resolved:
    """The batch layout actually used (logged as ``resolved.*``)."""
    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    world_size: int

    @property
    def effective_batch_size(self) -> int:
        """Examples per optimizer step: micro-batch x accumulation x processes."""
        return self.per_device_train_batch_size * self.gradient_accumulation_steps * self.world_size


def resolve(cfg: Config, world_size: int = 1, micro_batch: int | None = None) -> Resolved:
    """The batch layout for ``cfg`` on ``world_size`` processes (one GPU: 1).

    With ``per_device_train_batch_size: auto`` the caller passes the finder's ``micro_batch``;
    accumulation is then ``effective_batch_size / (micro_batch x world_size)``.
    Raises:
        ConfigError: ``auto`` without ``micro_batch``, or a micro-batch that does not divide the effective batch.
    """
    t = cfg.train
    if t.per_device_train_batch_size != "auto":
        return Resolved(int(t.per_device_train_batch_size), t.gradient_accumulation_steps, world_size)
    if micro_batch is None:
        raise ConfigError("train.per_device_train_batch_size is 'auto': the micro-batch finder must run first")
    per_step = micro_batch * world_size
    if t.effective_batch_size % per_step:
        raise ConfigError(f"train.effective_batch_size={t.effective_batch_size} is not divisible by "
                          f"micro-batch {micro_batch} x {world_size} process(es)")
    return Resolved(micro_batch, t.effective_batch_size // per_step, world_size)


# Params that decide only how the work is split or observed, not the mathematics of training.
# Left out of the equivalence key:
NOT_IN_EQUIVALENCE_KEY = {
    "train.per_device_train_batch_size": "how the effective batch is split (the effective batch is in)",
    "train.gradient_accumulation_steps": "how the effective batch is split (the effective batch is in)",
    "train.effective_batch_size": "replaced by the resolved effective batch size",
    "train.memory_budget_gib": "only steers the micro-batch finder",
    "train.gradient_checkpointing": "recomputes activations; the same mathematics",
    "train.backend": "Trainer and Accelerate loops compute the same steps",
    "train.logging_steps": "terminal output only",
    "train.oom_retry": "recovery re-splits the same effective batch",
    "train.save_steps": "checkpoints do not change the training",
    "train.dataloader_num_workers": "where batches are collated, not which",
    "evaluate.per_device_eval_batch_size": "evaluation only",
    "tracking.experiment_name": "where results are logged",
    "data.max_eval_samples": "evaluation data only",
}


MODEL_FROM_CONFIG_KEYS = ("model.n_layer", "model.n_embd", "model.n_head", "model.vocab_size")


def equivalence_fields(cfg: Config, resolved: Resolved, data_fingerprint: str = "") -> dict[str, Any]:
    """The values that define the mathematics of a training run.

    Everything in params.yaml except :data:`NOT_IN_EQUIVALENCE_KEY`, plus the resolved effective batch
    size and the prepared data's content fingerprint (so two runs on different data files never match).
    """
    flat = {k: v for k, v in flatten(cfg.to_dict()).items() if k not in NOT_IN_EQUIVALENCE_KEY}
    if cfg.model.name_or_path is not None:  # the sizes apply only to a model built from config
        for k in MODEL_FROM_CONFIG_KEYS:
            flat.pop(k, None)
    flat["resolved.effective_batch_size"] = resolved.effective_batch_size
    flat["data.fingerprint"] = data_fingerprint
    return flat


def run_config_hash(cfg: Config, data_fingerprint: str = "") -> str:
    """16 hex digits naming one exact training configuration (every param but tracking, evaluation and
    terminal output, plus the data fingerprint): a checkpoint resumes only a run with the same hash."""
    skip = ("tracking.", "evaluate.", "train.logging_steps", "train.save_steps")
    flat = {k: v for k, v in flatten(cfg.to_dict()).items() if not k.startswith(skip)}
    flat["data.fingerprint"] = data_fingerprint
    return hashlib.sha256(json.dumps(flat, sort_keys=True, default=str).encode()).hexdigest()[:16]


def equivalence_key(cfg: Config, resolved: Resolved, data_fingerprint: str = "") -> str:
    """A stable 16-hex-digit hash (SHA-256 of sorted JSON) of :func:`equivalence_fields`."""
    blob = json.dumps(equivalence_fields(cfg, resolved, data_fingerprint), sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
