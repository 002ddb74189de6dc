"""The ``train`` section: the batch layout, optimizer, precision, memory knobs, processes and machines,
validation (:class:`TrainConfig`; ``train.dpo``, ``train.fsdp``, ``train.gradient_checkpointing_kwargs``),
the choices it accepts, and the section's own combinations (:func:`check_train`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from onegpu.config.grpo import GRPOConfig
from onegpu.config.knobs import (
    CHOOSES,
    EACH_KEY,
    IN_KEY,
    POSITIVE_INT,
    SAME_RECOMPUTE,
    SEED,
    SHARDED,
    SPLIT,
    VALIDATION,
    WHERE,
    OutOfKey,
    fail,
    knob,
    null_or_one_of,
    one_of,
    positive_or_null,
)

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
                "eval_rewards/accuracies", "eval_rewards/margins", "eval_pass_rate")
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
        "num_processes >= 2)"), key=OutOfKey(SHARDED))
    reshard_after_forward: bool = knob(True, help=(
        "free each block's gathered weights after its forward, gather again for backward (accelerate's name)"),
        key=OutOfKey(SHARDED))


@dataclass
class CheckpointingKwargs:
    """``train.gradient_checkpointing_kwargs``: HF's keys of ``activation_checkpointing_kwargs``."""
    use_reentrant: bool = knob(False, help=(
        "torch's reentrant checkpoint variant; false = non-reentrant (torch's advice)"),
                               key=OutOfKey("how torch recomputes the checkpointed activations (reentrant or not)"
                                            + SAME_RECOMPUTE))
    every_n_layers: int = knob(1, help="recompute layers 0, n, 2n, ...: larger n = less recompute, more memory",
                               key=OutOfKey("which layers recompute their activations" + SAME_RECOMPUTE))


@dataclass
class TrainConfig:
    backend: str = knob("trainer", help="trainer (HF Trainer) | accelerate (onegpu's loop on Accelerate)",
                        rule=one_of(BACKENDS), key=OutOfKey("Trainer and Accelerate loops compute the same steps"))
    per_device_train_batch_size: Any = knob(8, key=SPLIT, help=(
        "micro-batch: an integer, or auto (the largest that fits; needs effective_batch_size)"))
    gradient_accumulation_steps: int = knob(1, key=SPLIT, help="micro-batches per optimizer step",
                                            rule=POSITIVE_INT)
    effective_batch_size: int | None = knob(None, help="null = micro-batch x accumulation x processes",
                                            key=OutOfKey("replaced by the resolved effective batch size"))
    num_processes: int = knob(1, help=(
        "data-parallel processes over all machines, as accelerate counts them (one per GPU; gloo on a CPU); "
        "> 1 launches torchrun"), rule=POSITIVE_INT, key=OutOfKey(
            "how the effective batch is split over processes (the effective batch is in)"))
    num_machines: int = knob(1, help=(
        "machines the processes span, num_processes / num_machines on each (accelerate's name); > 1: run "
        "`onegpu train` on every machine"), rule=POSITIVE_INT, key=WHERE)
    machine_rank: int = knob(0, help="this machine, 0 .. num_machines - 1; machine 0 holds rank 0, which writes the "
                                     "outputs and the MLflow run (torchrun's --node-rank)",
                             rule=(lambda v: v >= 0, "must be an integer >= 0, got {v}"), key=WHERE)
    main_process_ip: str | None = knob(None, help="machine 0's address, where the others meet it (torchrun's "
                                                  "--master-addr); required when num_machines > 1",
                                       rule=(lambda v: v is None or bool(v.strip()),
                                             "must be machine 0's address (e.g. 10.0.0.1) or null, got {v!r}"),
                                       key=WHERE)
    main_process_port: int | None = knob(None, help=(
        f"a free TCP port on machine 0 for the rendezvous; null = {DEFAULT_MAIN_PROCESS_PORT} (torchrun's default)"),
        rule=(lambda v: v is None or 1 <= v <= 65535, "must be a TCP port from 1 to 65535 or null, got {v}"),
        key=WHERE)
    memory_budget_gib: float | None = knob(None, help=(
        "for auto: the memory to fit in; null = free device memory (CUDA), required on a CPU"),
        rule=(lambda v: v is None or v > 0, "must be a positive number of GiB or null, got {v}"),
        key=OutOfKey("only steers the micro-batch finder"))
    oom_retry: bool = knob(True, help="a CUDA out-of-memory error in a step: halve the micro-batch, redo the step",
                           key=OutOfKey("recovery re-splits the same effective batch"))
    gradient_checkpointing: bool = knob(False, help="activation checkpointing: less memory, ~20-33% more compute",
                                        key=OutOfKey("recomputes activations" + SAME_RECOMPUTE))
    gradient_checkpointing_kwargs: CheckpointingKwargs = knob(
        default_factory=CheckpointingKwargs, key=EACH_KEY,
        help="how it checkpoints (HF's names); the defaults = every whole layer")
    gradient_checkpointing_blocks: str = knob("layer", help=(
        "layer | attention | mlp: the part of a chosen layer that recomputes (BERT-style, GPT-2)"),
        rule=one_of(CHECKPOINTING_BLOCKS),
        key=OutOfKey("which part of a layer recomputes its activations" + SAME_RECOMPUTE))
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
                                  "constant", rule=one_of(LR_SCHEDULERS))
    weight_decay: float = knob(0.0, key=IN_KEY, help="AdamW's decoupled weight decay",
                               rule=(lambda v: v >= 0, "must be >= 0, got {v}"))
    optim: str = knob("adamw_torch", key=IN_KEY, help=(
        "adamw_torch | adamw_torch_fused | adafactor | sgd | adagrad | rmsprop | adamw_bnb_8bit (CUDA) | "
        "adamw_torch_8bit | adamw_torch_4bit (torchao)"), rule=one_of(OPTIMIZERS + OPTIMIZERS_EXTRA))
    max_grad_norm: float = knob(1.0, key=IN_KEY, help="clip the gradients' total L2 norm to this; 0 = no clipping",
                                rule=(lambda v: v >= 0, "must be >= 0 (0 = no clipping), got {v}"))
    seed: int = knob(42, key=IN_KEY, help="model init, data order and dropout seed", rule=SEED)
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
        rule=null_or_one_of(COMPILE_MODES, "torch's default"),
        key=OutOfKey("how torch.compile tunes its kernels, not what they compute"))
    logging_steps: int = knob(10, help="terminal progress every N optimizer steps; MLflow gets every step",
                              rule=POSITIVE_INT, key=OutOfKey("terminal output only"))
    eval_strategy: str = knob("steps", help=(
        "validation during training (HF's names): no | steps (every eval_steps) | epoch; and at the end"),
        rule=one_of(EVAL_STRATEGIES), key=VALIDATION)
    eval_steps: float = knob(0.5, help=(
        "with steps: validate every N optimizer steps, or every such share of the run below 1 (as HF)"),
        rule=(lambda v: v > 0 and (v < 1 or float(v).is_integer()),
              "must be a positive integer (optimizer steps) or a fraction of the run in (0, 1), got {v}"),
        key=VALIDATION)
    load_best_model_at_end: bool = knob(False, help=(
        "models/ gets the weights of the best validation point (metric_for_best_model), not the last step's"),
        key=OutOfKey("chooses which validated step's weights are kept; the steps trained are the same"))
    metric_for_best_model: str = knob("eval_loss", help=(
        "the validation figure that ranks points: eval_loss, or eval_accuracy, eval_f1_macro, eval_perplexity, "
        "eval_mean_token_accuracy"), rule=one_of(BEST_METRICS), key=CHOOSES)
    greater_is_better: bool | None = knob(None, help="null = false for a loss or perplexity, true otherwise (HF's)",
                                          key=CHOOSES)
    early_stopping_patience: int | None = knob(None, help=(
        "stop after this many validation points without improvement (HF's EarlyStoppingCallback); null = never"),
        rule=(positive_or_null, "must be a positive integer (validation points) or null (= never), got {v}"),
        key=OutOfKey("where the run stops; the steps it trains are those of the run without it"))
    early_stopping_threshold: float = knob(0.0, help=(
        "an improvement must exceed this (absolute) to reset the patience"),
        rule=(lambda v: v >= 0, "must be >= 0, got {v}"), key=CHOOSES)
    save_steps: int | None = knob(None, help=(
        "resumable checkpoint every N optimizer steps; null = on Ctrl-C/SIGTERM only"),
        rule=(positive_or_null, "must be a positive integer or null, got {v}"),
        key=OutOfKey("checkpoints do not change the training"))
    dataloader_num_workers: int = knob(0, help="processes collating batches; 0 = in the training process",
                                       rule=(lambda v: v >= 0, "must be >= 0, got {v}"),
                                       key=OutOfKey("where batches are collated, not which"))
    dataloader_pin_memory: bool | None = knob(None, help="page-locked host batches; null = on with CUDA, off on CPU",
                                              key=OutOfKey("where host batches live before the copy to the "
                                                           "device, not their values"))
    torch_empty_cache_steps: int | None = knob(None, help=(
        "empty the CUDA allocator cache every N optimizer steps; null = never"),
        rule=(positive_or_null, "must be a positive integer (optimizer steps) or null (= never), got {v}"),
        key=OutOfKey("returns cached allocator blocks to the device; no arithmetic changes"))
    cpu_allocator: str = knob("caching", help=(
        "training on a CPU: keep freed memory for the next step | system (glibc's defaults)"),
        rule=one_of(CPU_ALLOCATORS), key=OutOfKey(
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
    grpo: GRPOConfig = knob(default_factory=GRPOConfig, key=EACH_KEY, help=(
        "GRPO on prompts with a verifiable answer (model.task: grpo), TRL's GRPOConfig names"))
    fsdp: FSDPConfig = knob(default_factory=FSDPConfig, key=EACH_KEY, help=(
        "FSDP2 sharding over the processes (torch's fully_shard), accelerate's FSDP plugin names"))

    @property
    def mixed_precision(self) -> str:
        """``"bf16"``, ``"fp16"`` or ``"no"`` (fp32): Accelerate's ``mixed_precision`` for the flags
        ``bf16``/``fp16`` (at most one is true; :func:`validate` refuses both)."""
        return "bf16" if self.bf16 else "fp16" if self.fp16 else "no"


def check_train(t: TrainConfig, source: str) -> None:
    """The micro-batch (an int or ``auto``), its agreement with the effective batch, one precision."""
    mb = t.per_device_train_batch_size
    if mb == "auto":
        if t.effective_batch_size is None:
            fail(source, "train.effective_batch_size", "is required with per_device_train_batch_size: auto "
                  "(the finder keeps it fixed and chooses how to split it)")
        if t.effective_batch_size < 1:
            fail(source, "train.effective_batch_size", f"must be a positive integer, got {t.effective_batch_size}")
        if t.effective_batch_size % t.num_processes:
            fail(source, "train.effective_batch_size", f"is {t.effective_batch_size}, not divisible by "
                  f"train.num_processes ({t.num_processes}): each process takes an equal share")
    elif isinstance(mb, bool) or not isinstance(mb, int) or mb < 1:
        fail(source, "train.per_device_train_batch_size", f"must be a positive integer or 'auto', got {mb!r}")
    if t.effective_batch_size is not None and mb != "auto":
        product = mb * t.gradient_accumulation_steps * t.num_processes
        if t.effective_batch_size != product:
            fail(source, "train.effective_batch_size",
                  f"is {t.effective_batch_size}, but per_device_train_batch_size x "
                  f"gradient_accumulation_steps x num_processes = {mb} x {t.gradient_accumulation_steps} x "
                  f"{t.num_processes} = {product}; make them agree or set effective_batch_size: null")
    check_machines(t, source)
    if t.bf16 and t.fp16:
        fail(source, "train.fp16", "train.bf16 and train.fp16 are both true; choose at most one")
    every = t.gradient_checkpointing_kwargs.every_n_layers
    if every < 1:
        fail(source, "train.gradient_checkpointing_kwargs.every_n_layers",
              f"must be a positive integer (1 = every layer, n = layers 0, n, 2n, ...), got {every}")
    if not t.gradient_checkpointing:
        changed = [f"{k}: {v!r}" for k, v, d in (
            ("gradient_checkpointing_kwargs.every_n_layers", every, 1),
            ("gradient_checkpointing_kwargs.use_reentrant", t.gradient_checkpointing_kwargs.use_reentrant, False),
            ("gradient_checkpointing_blocks", t.gradient_checkpointing_blocks, "layer")) if v != d]
        if changed:
            fail(source, "train.gradient_checkpointing", f"is false but {', '.join(changed)} asks for a "
                  "checkpointing granularity; set train.gradient_checkpointing: true or leave those at their "
                  "defaults (every_n_layers 1, use_reentrant false, blocks layer)")
    if t.torch_compile_mode is not None and not t.torch_compile:
        fail(source, "train.torch_compile_mode", f"is {t.torch_compile_mode!r} but train.torch_compile is false; "
              "set train.torch_compile: true or the mode to null")


def check_machines(t: TrainConfig, source: str) -> None:
    """``train.num_machines`` with ``machine_rank`` below it, ``num_processes`` an equal share per machine and
    ``main_process_ip`` given (accelerate's names; :func:`onegpu.training.parallel.distributed.torchrun_args`)."""
    if t.machine_rank >= t.num_machines:
        fail(source, "train.machine_rank", f"is {t.machine_rank} but train.num_machines is {t.num_machines}: "
              f"machines are numbered 0 .. {t.num_machines - 1}")
    if t.num_machines > 1 and t.num_processes % t.num_machines:
        fail(source, "train.num_processes", f"is {t.num_processes}, not divisible by train.num_machines "
              f"({t.num_machines}): num_processes counts the processes of all machines (accelerate's meaning), "
              "each machine runs an equal share")
    if t.num_machines > 1 and t.main_process_ip is None:
        fail(source, "train.main_process_ip", f"is required with train.num_machines: {t.num_machines}: machine 0's "
              "address, where the other machines meet it (e.g. 10.0.0.1; 127.0.0.1 for machines on one host)")
