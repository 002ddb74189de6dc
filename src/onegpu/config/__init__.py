"""params.yaml: the typed schema, loading and validation, one module per section.

Every stage calls :func:`load` first, so a typo, a wrong type or an out-of-range value stops the stage
with one message naming the key before any data is read. Keys in ``train`` use the names of
``transformers.TrainingArguments`` where one exists.

The modules, each importing only those above it: :mod:`.knobs` (how a key is declared), the sections
:mod:`.data`, :mod:`.model`, :mod:`.grpo`, :mod:`.train`, :mod:`.evaluate`, :mod:`.tracking` (each its dataclasses,
choices and own combinations), :mod:`.schema` (the whole :class:`Config` and what is derived from the declarations),
:mod:`.layout` (the resolved batch layout), :mod:`.checks` (:func:`validate`), :mod:`.loading`, :mod:`.device`.
They import only the standard library and OmegaConf, so validation errors come back at once. The names the
rest of onegpu uses are here too (``from onegpu.config import Config``).
"""
from __future__ import annotations

from onegpu.config.checks import COMBINATIONS, TASK_EVAL_METRICS, validate
from onegpu.config.data import (
           PACKAGED_DATA,
           PACKAGED_HEADLINES,
           PACKAGED_PAIRS,
           PACKAGED_SECTIONS,
           PACKAGED_SOURCES,
           TABLE_SUFFIXES,
           DataConfig,
)
from onegpu.config.device import DEVICE_CHECKS, OPTIONAL_PACKAGES, DeviceFacts, check_device
from onegpu.config.evaluate import EvaluateConfig
from onegpu.config.grpo import GRPO_LOSS_TYPES, SCALE_REWARDS, GRPOConfig
from onegpu.config.knobs import EACH_KEY, IN_KEY, OutOfKey, Rule, knob
from onegpu.config.layout import Resolved, flatten, resolve, with_layout
from onegpu.config.loading import apply_override, from_container, load
from onegpu.config.model import (
           ATTN_IMPLEMENTATIONS,
           PACKAGED_CHAT_MODEL,
           PACKAGED_MODEL,
           TASK_TRAITS,
           TASKS,
           LoraConfig,
           ModelConfig,
           TaskTraits,
           causal_lm,
           has_reference,
           token_level,
)
from onegpu.config.schema import RULES, SECTIONS, SUBSECTIONS, Config, declarations, help_text, out_of_key
from onegpu.config.tracking import TrackingConfig
from onegpu.config.train import (
           BACKENDS,
           BEST_METRICS,
           CHECKPOINTING_BLOCKS,
           COMPILE_MODES,
           CPU_ALLOCATORS,
           DEFAULT_MAIN_PROCESS_PORT,
           DPO_LOSS_TYPES,
           EVAL_STRATEGIES,
           LOW_BIT_OPTIMIZERS,
           LR_SCHEDULERS,
           OPTIMIZERS,
           OPTIMIZERS_EXTRA,
           TORCHAO_OPTIMIZERS,
           CheckpointingKwargs,
           DPOConfig,
           FSDPConfig,
           TrainConfig,
)

__all__ = ["ATTN_IMPLEMENTATIONS", "BACKENDS", "BEST_METRICS", "CHECKPOINTING_BLOCKS", "COMBINATIONS",
           "COMPILE_MODES", "CPU_ALLOCATORS", "CheckpointingKwargs", "Config", "DEFAULT_MAIN_PROCESS_PORT",
           "DEVICE_CHECKS", "DPOConfig", "DPO_LOSS_TYPES", "DataConfig", "DeviceFacts", "EACH_KEY", "EVAL_STRATEGIES",
           "EvaluateConfig", "FSDPConfig", "GRPOConfig", "GRPO_LOSS_TYPES", "IN_KEY", "LOW_BIT_OPTIMIZERS",
           "LR_SCHEDULERS", "LoraConfig", "ModelConfig", "OPTIMIZERS", "OPTIMIZERS_EXTRA", "OPTIONAL_PACKAGES",
           "OutOfKey", "PACKAGED_CHAT_MODEL", "PACKAGED_DATA", "PACKAGED_HEADLINES", "PACKAGED_MODEL",
           "PACKAGED_PAIRS", "PACKAGED_SECTIONS", "PACKAGED_SOURCES", "RULES", "Resolved", "Rule", "SCALE_REWARDS",
           "SECTIONS", "SUBSECTIONS", "TABLE_SUFFIXES", "TASKS", "TASK_EVAL_METRICS", "TASK_TRAITS",
           "TORCHAO_OPTIMIZERS", "TaskTraits", "TrackingConfig", "TrainConfig", "apply_override", "causal_lm",
           "check_device", "declarations", "flatten", "from_container", "has_reference", "help_text", "knob", "load",
           "out_of_key", "resolve", "token_level", "validate", "with_layout"]
