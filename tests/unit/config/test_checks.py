"""onegpu.config.checks: each key's rule and each combination refused in one line naming the key; what is
allowed passes."""
from __future__ import annotations

import re

import pytest

from onegpu import config
from onegpu.errors import ConfigError, UserError

# -- bad inputs ----------------------------------------------------------------------------------

def _set(d: dict, dotted: str, value) -> None:
    *path, key = dotted.split(".")
    for part in path:
        d = d.setdefault(part, {})
    d[key] = value


BAD = [
    # (id, {dotted key: value}, key the message must name, other text the message must hold)
    ("unknown-train-key", {"train.gradient_acumulation_steps": 4},
     "train.gradient_acumulation_steps", ["gradient_accumulation_steps", "Did you mean"]),
    ("unknown-model-key", {"model.dropuot": 0.1}, "model.dropuot", ["model.dropout"]),
    ("unknown-section", {"trainer": {"seed": 1}}, "trainer", ["unknown key", "'train'"]),
    ("micro-0", {"train.per_device_train_batch_size": 0}, "train.per_device_train_batch_size",
     ["positive integer"]),
    ("micro-abc", {"train.per_device_train_batch_size": "abc"}, "train.per_device_train_batch_size",
     ["'abc'"]),
    ("micro-auto-without-effective", {"train.per_device_train_batch_size": "auto"}, "train.effective_batch_size",
     ["required", "auto"]),
    ("micro-bool", {"train.per_device_train_batch_size": True}, "train.per_device_train_batch_size",
     ["positive integer"]),
    ("micro-float", {"train.per_device_train_batch_size": 2.5}, "train.per_device_train_batch_size",
     ["positive integer"]),
    ("accum-neg", {"train.gradient_accumulation_steps": -1}, "train.gradient_accumulation_steps",
     ["positive integer", "-1"]),
    ("accum-abc", {"train.gradient_accumulation_steps": "abc"}, "train.gradient_accumulation_steps",
     ["integer", "'abc'"]),
    ("lr-abc", {"train.learning_rate": "abc"}, "train.learning_rate", ["a number", "'abc'"]),
    ("lr-0", {"train.learning_rate": 0}, "train.learning_rate", ["positive"]),
    ("lr-neg", {"train.learning_rate": -1e-4}, "train.learning_rate", ["positive"]),
    ("max-steps-0", {"train.max_steps": 0}, "train.max_steps", ["-1"]),
    ("max-steps-minus-2", {"train.max_steps": -2}, "train.max_steps", ["-1"]),
    ("bf16-and-fp16", {"train.bf16": True, "train.fp16": True}, "train.fp16", ["train.bf16"]),
    ("bf16-not-bool", {"train.bf16": "maybe"}, "train.bf16", ["true or false"]),
    ("validation-size-1.5", {"data.validation_size": 1.5}, "data.validation_size", ["between 0 and 1"]),
    ("test-size-0", {"data.test_size": 0.0}, "data.test_size", ["between 0 and 1"]),
    ("splits-leave-no-train", {"data.validation_size": 0.5, "data.test_size": 0.45}, "data.test_size",
     ["10%"]),
    ("source-txt", {"data.source": "foo.txt"}, "data.source", ["'foo.txt'", ".csv"]),
    ("task-xyz", {"model.task": "xyz"}, "model.task", ["'xyz'", "sequence-classification"]),
    ("dropout-1.0", {"model.dropout": 1.0}, "model.dropout", ["[0, 1)"]),
    ("dropout-neg", {"model.dropout": -0.1}, "model.dropout", ["[0, 1)"]),
    ("scheduler-nope", {"train.lr_scheduler_type": "nope"}, "train.lr_scheduler_type",
     ["'nope'", "cosine"]),
    ("optim-nope", {"train.optim": "nope"}, "train.optim", ["'nope'", "adamw_torch"]),
    ("max-length-2", {"data.max_length": 2}, "data.max_length", ["8 to 8192"]),
    ("epochs-0", {"train.num_train_epochs": 0}, "train.num_train_epochs", ["positive"]),
    ("max-train-samples-0", {"data.max_train_samples": 0}, "data.max_train_samples", ["positive"]),
    ("max-train-samples-str", {"data.max_train_samples": "many"}, "data.max_train_samples",
     ["integer or null"]),
    ("warmup-1", {"train.warmup_ratio": 1.0}, "train.warmup_ratio", ["[0, 1)"]),
    ("backend-nope", {"train.backend": "nope"}, "train.backend", ["trainer"]),
    ("eval-batch-0", {"evaluate.per_device_eval_batch_size": 0}, "evaluate.per_device_eval_batch_size",
     ["positive"]),
    ("experiment-blank", {"tracking.experiment_name": "  "}, "tracking.experiment_name", ["non-empty"]),
    ("memory-budget-0", {"train.memory_budget_gib": 0}, "train.memory_budget_gib", ["positive"]),
    # the single-GPU guide's knobs (issue 12)
    ("tf32-not-bool", {"train.tf32": "maybe"}, "train.tf32", ["true or false"]),
    ("optim-8bit-typo", {"train.optim": "adamw_8bit"}, "train.optim", ["'adamw_8bit'", "adamw_bnb_8bit"]),
    ("optim-2bit", {"train.optim": "adamw_torch_2bit"}, "train.optim",
     ["'adamw_torch_2bit'", "adamw_torch_8bit", "adamw_torch_4bit"]),
    ("attn-nope", {"model.attn_implementation": "flash"}, "model.attn_implementation",
     ["'flash'", "eager", "sdpa", "flash_attention_2"]),
    ("compile-not-bool", {"train.torch_compile": "yes please"}, "train.torch_compile", ["true or false"]),
    ("compile-mode-nope", {"train.torch_compile": True, "train.torch_compile_mode": "fast"},
     "train.torch_compile_mode", ["'fast'", "max-autotune"]),
    ("compile-mode-without-compile", {"train.torch_compile_mode": "max-autotune"}, "train.torch_compile_mode",
     ["train.torch_compile is false"]),
    ("pin-memory-not-bool", {"train.dataloader_pin_memory": "sometimes"}, "train.dataloader_pin_memory",
     ["true, false or null"]),
    ("empty-cache-0", {"train.torch_empty_cache_steps": 0}, "train.torch_empty_cache_steps",
     ["positive integer", "null"]),
    ("empty-cache-str", {"train.torch_empty_cache_steps": "often"}, "train.torch_empty_cache_steps",
     ["integer or null"]),
    ("cpu-allocator-nope", {"train.cpu_allocator": "jemalloc"}, "train.cpu_allocator",
     ["'jemalloc'", "caching", "system"]),
    ("processes-zero", {"train.num_processes": 0}, "train.num_processes", ["positive integer"]),
    ("processes-float", {"train.num_processes": 1.5}, "train.num_processes", []),
    ("auto-not-divisible-by-processes", {"train.per_device_train_batch_size": "auto",
                                         "train.effective_batch_size": 9, "train.num_processes": 2},
     "train.effective_batch_size", ["not divisible by train.num_processes (2)"]),
    # instruction data (issue 21): causal LM only
    ("padding-free-classifier", {"data.padding_free": True}, "data.padding_free", ["causal-lm and preference only"]),
    ("packing-classifier", {"data.packing": True}, "data.packing", ["causal-lm only"]),
    ("completion-only-classifier", {"data.completion_only_loss": True}, "data.completion_only_loss", ["causal-lm"]),
    ("headlines-classifier", {"data.source": "bbcnews-headlines"}, "data.source", ["instruction data"]),
    ("padding-free-not-bool", {"data.padding_free": "sometimes"}, "data.padding_free", ["true or false"]),
    ("completion-only-not-bool", {"data.completion_only_loss": "maybe"}, "data.completion_only_loss",
     ["true, false or null"]),
    ("assistant-only-classifier", {"data.assistant_only_loss": True}, "data.assistant_only_loss", ["causal-lm only"]),
    ("packing-not-bool", {"data.packing": "sometimes"}, "data.packing", ["true or false"]),
    ("assistant-only-not-bool", {"data.assistant_only_loss": "maybe"}, "data.assistant_only_loss", ["true or false"]),
    # preference tuning (issue 42): its data, its keys
    ("pairs-classifier", {"data.source": "bbcnews-headline-pairs"}, "data.source",
     ["preference pairs", "for model.task: preference, but model.task is sequence-classification"]),
    ("headlines-preference", {"data.source": "bbcnews-headlines", "model.task": "preference",
                              "model.name_or_path": None}, "data.source", ["for model.task: causal-lm"]),
    ("packing-preference", {"data.source": "bbcnews-headline-pairs", "model.task": "preference",
                            "model.name_or_path": None, "data.packing": True}, "data.packing", ["causal-lm only"]),
    ("completion-only-preference", {"data.source": "bbcnews-headline-pairs", "model.task": "preference",
                                    "model.name_or_path": None, "data.completion_only_loss": True},
     "data.completion_only_loss", ["causal-lm only"]),
    ("dpo-beta-0", {"train.dpo.beta": 0}, "train.dpo.beta", ["positive number"]),
    ("dpo-loss-unknown", {"train.dpo.loss_type": ["kto"]}, "train.dpo.loss_type", ["sigmoid", "sigmoid_norm"]),
    ("dpo-loss-empty", {"train.dpo.loss_type": []}, "train.dpo.loss_type", ["non-empty list"]),
    ("dpo-loss-string", {"train.dpo.loss_type": "ipo"}, "train.dpo.loss_type", ["a list of strings"]),
    ("dpo-weights-count", {"train.dpo.loss_weights": [1.0, 0.5]}, "train.dpo.loss_weights",
     ["2 weights for 1 loss types"]),
    ("dpo-smoothing-half", {"train.dpo.label_smoothing": 0.5}, "train.dpo.label_smoothing", ["[0, 0.5)"]),
    ("dpo-dropout-both", {"data.source": "bbcnews-headline-pairs", "model.task": "preference",
                          "model.name_or_path": None, "model.dropout": 0.1}, "model.dropout",
     ["train.dpo.disable_dropout is true"]),
    ("max-new-tokens-0", {"evaluate.max_new_tokens": 0}, "evaluate.max_new_tokens", ["from 1 to 4096"]),
    # train.fsdp (issue 43's first slice): each combination it does not run yet, refused in one line
    ("fsdp-not-a-mapping", {"train.fsdp": True}, "train.fsdp", ["a mapping with keys enabled"]),
    ("fsdp-trainer", {"train.fsdp.enabled": True}, "train.fsdp.enabled",
     ["with train.backend", "engages on GPUs only", "set train.backend: accelerate"]),
    *[(f"fsdp-with-{name}", {"train.fsdp.enabled": True, "train.backend": "accelerate", "train.num_processes": 2,
                             "train.eval_strategy": "no", "train.oom_retry": False, **changes},
       "train.fsdp.enabled", [f"with {key}:", want])
      for name, changes, key, want in (
          ("one-process", {"train.num_processes": 1}, "train.num_processes", "one process has nothing to shard"),
          ("oom-retry", {"train.oom_retry": True}, "train.oom_retry", "set train.oom_retry: false"),
          ("compile", {"train.torch_compile": True}, "train.torch_compile", "set train.torch_compile: false"),
          ("fp16", {"train.fp16": True}, "train.fp16", "use bf16 or neither"))],
    ("source-parquet-typo", {"data.source": "d.parqet"}, "data.source", [".parquet"]),
]


@pytest.mark.parametrize("changes, key, extra", [pytest.param(c, k, e, id=i) for i, c, k, e in BAD])
def test_bad_value_raises_config_error_naming_the_key(raw, changes, key, extra):
    for dotted, value in changes.items():
        _set(raw, dotted, value)
    with pytest.raises(ConfigError) as ei:
        config.from_container(raw)
    msg = str(ei.value)
    assert key in msg, msg
    for text in extra:
        assert text in msg, msg
    assert "\n" not in msg  # one line for the CLI
    assert isinstance(ei.value, UserError)


def test_fsdp_is_accepted_with_what_its_first_slice_runs(raw):
    """docs/details.md's FSDP2 command: the accelerate backend, 2 processes, no validation during training, no
    out-of-memory retry (a classifier: no fused head to turn off); checkpoints every train.save_steps (sharded)."""
    for dotted, value in {"train.fsdp.enabled": True, "train.fsdp.reshard_after_forward": False,
                          "train.backend": "accelerate", "train.num_processes": 2, "train.eval_strategy": "no",
                          "train.oom_retry": False, "train.per_device_train_batch_size": 4,
                          "train.save_steps": 10, "model.lora": {"r": 8}, "train.num_machines": 2,
                          "train.main_process_ip": "10.0.0.1"}.items():  # over machines: machines.agree's check
        _set(raw, dotted, value)
    cfg = config.from_container(raw)  # with LoRA adapters too (proven in
    # tests/unit/training/parallel/test_distributed.py)
    assert cfg.train.fsdp == config.FSDPConfig(enabled=True, reshard_after_forward=False) and cfg.model.lora.r == 8


@pytest.mark.parametrize("task, source", [("causal-lm", "bbcnews-headlines"),
                                          ("preference", "bbcnews-headline-pairs")])
def test_fsdp_is_accepted_with_the_fused_lm_head(raw, task, source):
    """The fused LM head (the default) of a causal LM and of DPO under sharding: its tiles project with the root's
    gathered head (training/parallel/sharding.py:shard; proven in float64 by test_distributed.py's fused-* cases and
    test_same_training_preference.py's *-fused cases); it was refused, and every sharded causal LM turned it off."""
    for dotted, value in {"train.fsdp.enabled": True, "train.backend": "accelerate", "train.num_processes": 2,
                          "train.oom_retry": False, "model.task": task, "model.name_or_path": None,
                          "data.source": source}.items():
        _set(raw, dotted, value)
    cfg = config.from_container(raw)
    assert cfg.train.fsdp.enabled and cfg.train.fused_lm_head and config.causal_lm(cfg.model.task)


def test_effective_batch_size_disagreeing_names_the_product(raw):
    raw["train"].update(per_device_train_batch_size=8, gradient_accumulation_steps=2, effective_batch_size=32)
    with pytest.raises(ConfigError) as ei:
        config.from_container(raw)
    msg = str(ei.value)
    assert "train.effective_batch_size" in msg
    assert "8 x 2 x 1 = 16" in msg
    assert "32" in msg


def test_effective_batch_size_counts_the_processes(raw):
    raw["train"].update(per_device_train_batch_size=8, gradient_accumulation_steps=2, effective_batch_size=32,
                        num_processes=2)
    cfg = config.from_container(raw)
    assert config.resolve(cfg) == config.Resolved(8, 2, 2)
    assert config.resolve(cfg).effective_batch_size == 32


def test_effective_batch_size_equal_to_product_is_accepted(raw):
    raw["train"].update(per_device_train_batch_size=4, gradient_accumulation_steps=4, effective_batch_size=16)
    cfg = config.from_container(raw)
    assert cfg.train.effective_batch_size == 16
    assert config.resolve(cfg).effective_batch_size == 16
    assert config.resolve(cfg, world_size=2).effective_batch_size == 32


@pytest.mark.parametrize("key", ["train.seed", "data.seed"])
def test_negative_seed_is_rejected(raw, key):
    _set(raw, key, -1)
    with pytest.raises(ConfigError, match=re.escape(key)):
        config.from_container(raw)


def test_guide_knobs_accept_their_values(raw):
    for changes in ({"train.tf32": True}, {"train.optim": "adamw_bnb_8bit"}, {"train.optim": "adafactor"},
                    {"train.optim": "adamw_torch_fused"}, {"model.attn_implementation": "sdpa"},
                    {"model.attn_implementation": "eager"}, {"model.attn_implementation": "flash_attention_2"},
                    {"train.torch_compile": True, "train.torch_compile_mode": "reduce-overhead"},
                    {"train.dataloader_pin_memory": False}, {"train.torch_empty_cache_steps": 5}):
        d = __import__("copy").deepcopy(raw)
        for dotted, value in changes.items():
            _set(d, dotted, value)
        cfg = config.from_container(d)
        for dotted, value in changes.items():
            section, name = dotted.split(".")
            assert getattr(getattr(cfg, section), name) == value
