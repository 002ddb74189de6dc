"""params.yaml: schema, validation messages, overrides and flattening."""
from __future__ import annotations

import re

import pytest
import yaml

from onegpu import config
from onegpu.errors import ConfigError, UserError
from tests import defaults


@pytest.fixture
def raw() -> dict:
    """The repo's committed params.yaml as a plain dict (a fresh copy per test)."""
    return defaults.params()




# -- the repo's params.yaml ----------------------------------------------------------------------

def test_repo_params_yaml_loads_and_validates(tmp_path):
    cfg = config.load(defaults.write_params(tmp_path))
    assert isinstance(cfg, config.Config)
    given = config.flatten(defaults.params())
    loaded = config.flatten(cfg.to_dict())
    # every key given in the file is a schema key, and its value arrives unchanged (modulo int -> float)
    for k, v in given.items():
        assert k in loaded, k
        assert loaded[k] == v, k
    assert cfg.tracking.experiment_name
    assert cfg.model.task in config.TASKS


def test_defaults_fill_missing_sections():
    cfg = config.from_container({"train": {"learning_rate": 3e-4}})
    assert cfg.train.learning_rate == 3e-4
    assert cfg.data.source == config.PACKAGED_DATA
    assert cfg.model.name_or_path == config.PACKAGED_MODEL
    assert cfg.tracking.experiment_name == "onegpu"


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


def test_message_names_the_source_file(tmp_path, raw):
    raw["train"]["optim"] = "nope"
    p = tmp_path / "my-params.yaml"
    p.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match=r"my-params\.yaml: train\.optim: "):
        config.load(p)


def test_load_from_file_round_trip(tmp_path, raw):
    raw["train"]["gradient_accumulation_steps"] = 7
    raw["model"]["dropout"] = 0.25
    p = tmp_path / "params.yaml"
    p.write_text(yaml.safe_dump(raw))
    cfg = config.load(p)
    assert cfg.train.gradient_accumulation_steps == 7
    assert cfg.model.dropout == 0.25


def test_yaml_exponent_without_dot_is_a_float(tmp_path, raw):
    # PyYAML reads `1e-4` as a string; OmegaConf's loader and the float field must give a number.
    text = defaults.params_text()
    text = re.sub(r"(?m)^(\s*learning_rate:).*$", r"\1 3e-4", text)
    p = tmp_path / "params.yaml"
    p.write_text(text)
    assert config.load(p).train.learning_rate == pytest.approx(3e-4)


def test_load_missing_file_raises_config_error(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        config.load(tmp_path / "nope.yaml")


def test_load_invalid_yaml_raises_config_error(tmp_path):
    p = tmp_path / "params.yaml"
    p.write_text("train:\n  seed: [1, 2\n  lr: : :\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        config.load(p)


@pytest.mark.parametrize("text", [
    "",
    "- a\n- b\n",
    "just a string\n",
])
def test_load_non_mapping_raises_config_error(tmp_path, text):
    p = tmp_path / "params.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError, match="mapping"):
        config.load(p)


def test_section_given_as_scalar_names_the_section(raw):
    raw["train"] = 5
    with pytest.raises(ConfigError) as ei:
        config.from_container(raw)
    assert "train" in str(ei.value).split(":", 1)[1]


@pytest.mark.parametrize("key", ["train.seed", "data.seed"])
def test_negative_seed_is_rejected(raw, key):
    _set(raw, key, -1)
    with pytest.raises(ConfigError, match=re.escape(key)):
        config.from_container(raw)


# -- flatten -------------------------------------------------------------------------------------

def test_flatten_gives_dotted_keys(raw):
    flat = config.flatten(raw)
    assert "train.gradient_accumulation_steps" in flat
    assert flat["train.gradient_accumulation_steps"] == raw["train"]["gradient_accumulation_steps"]
    assert flat["tracking.experiment_name"] == raw["tracking"]["experiment_name"]
    assert not any(isinstance(v, dict) for v in flat.values())
    # one entry per leaf value (a mapping inside a section, e.g. train.gradient_checkpointing_kwargs, is
    # flattened to section.mapping.key)
    def leaves(d):
        return sum(leaves(v) if isinstance(v, dict) else 1 for v in d.values())
    assert len(flat) == leaves(raw)


def test_flatten_nested_and_none():
    assert config.flatten({"a": {"b": {"c": 1}, "d": None}, "e": 2}) == {"a.b.c": 1, "a.d": None, "e": 2}


def test_flatten_of_config_has_every_schema_key():
    flat = config.flatten(config.Config().to_dict())
    assert flat["train.per_device_train_batch_size"] == 8
    assert flat["model.dropout"] is None
    # section.key, or section.mapping.key for the mappings inside a section (SUBSECTIONS)
    assert all(k.count(".") == 1 or k.rpartition(".")[0] in config.SUBSECTIONS for k in flat)
    assert flat["train.gradient_checkpointing_kwargs.use_reentrant"] is False


# `dvc exp run -S train.max_grad_norm=.inf` goes through Hydra's override grammar, which reads `.inf` and
# `.nan` as *strings* and writes them quoted into params.yaml; `inf`/`nan` become floats. Both spellings
# must say "must be finite", never "expected a number".
@pytest.mark.parametrize("key", ["train.max_grad_norm", "train.learning_rate", "train.weight_decay",
                                 "train.warmup_ratio", "train.memory_budget_gib", "train.num_train_epochs",
                                 "model.dropout", "data.validation_size", "data.test_size"])
@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan", float("inf"), float("nan")])
def test_non_finite_float_says_must_be_finite(raw, key, value):
    section, name = key.split(".")
    raw[section][name] = value
    with pytest.raises(ConfigError) as e:
        config.from_container(raw)
    msg = str(e.value)
    assert f"{key}: must be finite" in msg, msg
    assert "expected a number" not in msg


@pytest.mark.parametrize("key", ["data.max_train_samples", "data.max_eval_samples", "train.max_steps"])
def test_non_finite_integer_says_must_be_finite(raw, key):
    section, name = key.split(".")
    raw[section][name] = ".inf"
    with pytest.raises(ConfigError, match=rf"{re.escape(key)}: must be finite"):
        config.from_container(raw)


# -- -S overrides (OmegaConf.from_dotlist) -------------------------------------------------------

def test_overrides_are_parsed_as_yaml_and_merged(tmp_path, raw):
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(raw))
    cfg = config.load(path, ["train.gradient_accumulation_steps=4", "train.learning_rate=1e-4",
                             "train.bf16=true", "data.max_train_samples=null", "train.effective_batch_size=null"])
    assert cfg.train.gradient_accumulation_steps == 4
    assert cfg.train.learning_rate == 1e-4  # YAML 1.2 exponent without a dot: a float
    assert cfg.train.bf16 is True and cfg.data.max_train_samples is None
    assert cfg.model.name_or_path == raw["model"]["name_or_path"]  # untouched keys stay


def test_override_into_a_section_the_file_leaves_out(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text("data:\n  max_length: 32\n")
    assert config.load(path, ["tracking.experiment_name=sweep"]).tracking.experiment_name == "sweep"


def test_override_unparsable_value_is_named_with_its_key(tmp_path, raw):
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError) as e:
        config.load(path, ["train.learning_rate=[1,"])
    assert "train.learning_rate: expected a number, got '[1,'" in str(e.value)


@pytest.mark.parametrize("item", ["learning_rate", "train.learning_rate", "=1", "train..seed=1", ".seed=1"])
def test_override_not_dotted_key_value(tmp_path, raw, item):
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match="expected section.key=value"):
        config.load(path, [item])


# -- type messages per section, precision ----------------------------------------------------------

@pytest.mark.parametrize("key, expected", [
    ("data.seed", "an integer"), ("train.seed", "an integer"), ("data.max_eval_samples", "an integer or null"),
    ("model.dropout", "a number or null"), ("train.gradient_checkpointing", "true or false"),
    ("train.memory_budget_gib", "a number or null"), ("model.name_or_path", "a string or null"),
    ("evaluate.per_device_eval_batch_size", "an integer"),
])
def test_type_message_names_the_type_of_the_key_in_its_section(raw, key, expected):
    section, name = key.split(".")
    raw[section][name] = [1, 2]
    with pytest.raises(ConfigError) as e:
        config.from_container(raw)
    assert f"{key}: expected {expected}, got [1, 2]" in str(e.value)


@pytest.mark.parametrize("bf16, fp16, expected", [(True, False, "bf16"), (False, True, "fp16"), (False, False, "no")])
def test_mixed_precision_from_the_flags(bf16, fp16, expected):
    assert config.TrainConfig(bf16=bf16, fp16=fp16).mixed_precision == expected


def test_every_rule_names_a_schema_key():
    schema = set(config.flatten(config.Config().to_dict()))
    assert set(config.RULES) <= schema
    assert set(config.COMBINATIONS) <= set(config.SECTIONS)


# -- each key declared once (config.knob) ----------------------------------------------------------

def _every_key() -> list[str]:
    """Every leaf of params.yaml's schema, the mappings filled (``model.lora`` is null by default)."""
    cfg = config.Config(model=config.ModelConfig(lora=config.LoraConfig()))
    return list(config.flatten(cfg.to_dict()))


def test_every_key_is_declared_in_or_out_of_the_equivalence_key_with_help():
    """Every data.*, model.*, train.*, evaluate.* and tracking.* key is a knob: in the key, or out of it with
    a reason; a mapping's own field says its keys are classified; every one has a line of help."""
    declared = config.declarations()
    assert list(declared) == _every_key()
    for key, f in declared.items():
        assert f.metadata["key"] == config.IN_KEY or f.metadata["key"].why.strip(), key
        assert f.metadata["help"].strip() and "\n" not in f.metadata["help"], key
    mappings = {k: f for k, f in config.declarations(leaves=False).items() if k not in declared}
    assert sorted(mappings) == sorted(config.SUBSECTIONS)
    assert all(f.metadata["key"] == config.EACH_KEY for f in mappings.values())
    assert len(declared) == 80  # the schema's keys today: a new key is declared with knob()


def test_the_key_the_rules_and_the_help_are_derived_from_the_declarations():
    from onegpu.equivalence import NOT_IN_EQUIVALENCE_KEY
    assert NOT_IN_EQUIVALENCE_KEY == config.out_of_key()
    assert NOT_IN_EQUIVALENCE_KEY["train.gradient_accumulation_steps"].startswith("how the effective batch is split")
    assert "train.learning_rate" not in NOT_IN_EQUIVALENCE_KEY and "data.packing" not in NOT_IN_EQUIVALENCE_KEY
    assert config.RULES["train.optim"][0]("adamw_torch_4bit") and not config.RULES["train.optim"][0]("adam")
    assert config.help_text("train.gradient_accumulation_steps") == "micro-batches per optimizer step"


def test_a_knob_must_say_whether_it_is_in_the_key():
    with pytest.raises(TypeError, match="IN_KEY"):
        config.knob(1, help="a new knob", key="maybe")


def _params_yaml_lines() -> list[tuple[str, str]]:
    """(dotted key, its comment) of each key line of the committed params.yaml, in file order."""
    out, stack = [], []
    for line in defaults.params_text().splitlines():
        m = re.match(r"^( *)([A-Za-z_]\w*):[^#]*?(?:#\s?(.*))?$", line)
        if m:
            stack = stack[:len(m.group(1)) // 2] + [m.group(2)]
            out.append((".".join(stack), (m.group(3) or "").strip()))
    return out


def test_params_yaml_holds_every_key_in_schema_order_with_its_declared_help():
    """params.yaml's comment on each key's line is the key's declared help (config.knob), word for word."""
    lines = [(k, c) for k, c in _params_yaml_lines() if k not in config.SECTIONS]
    assert [k for k, _ in lines] == list(config.declarations(leaves=False))
    for key, comment in lines:
        assert comment == config.help_text(key), key


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


def test_every_key_of_the_schema_is_in_params_yaml():
    """`dvc exp run -S section.key=value` sets only keys params.yaml has (a missing one, or one under a
    null, fails in DVC: "Key ... is not in struct"): every documented knob is there, nested ones too."""
    have = config.flatten(defaults.params())
    assert sorted(set(config.flatten(config.Config().to_dict())) - set(have) - {"model.lora"}) == []
    assert {k for k in have if k.startswith("model.lora.")} == {f"model.lora.{f}" for f in
                                                                ("r", "alpha", "dropout", "target_modules")}


# -- the machine's combinations (config.check_device): one line each, before any work -----------------

CPU = config.DeviceFacts()
GPU = config.DeviceFacts(cuda=True, gpus=2, name="NVIDIA T4", bf16=False, tf32=False)


@pytest.mark.parametrize("train, model, facts, key, words", [
    ({"num_processes": 4}, {}, GPU, "train.num_processes", "4 processes need 4 GPUs (one each) and 2 is/are visible"),
    ({"fp16": True}, {}, CPU, "train.fp16", "fp16 mixed precision needs a CUDA GPU"),
    ({"bf16": True}, {}, GPU, "train.bf16", "NVIDIA T4 has no bf16 support; use fp16"),
    ({"optim": "adamw_bnb_8bit"}, {}, GPU, "train.optim", "needs the bitsandbytes package"),
    ({"optim": "adamw_bnb_8bit"}, {}, config.DeviceFacts(packages=frozenset({"bitsandbytes"})), "train.optim",
     "adamw_bnb_8bit (bitsandbytes) needs a CUDA GPU"),
    ({"optim": "adamw_torch_8bit"}, {}, GPU, "train.optim",
     "adamw_torch_8bit needs the torchao package, which is not installed (pip install torchao)"),
    ({"optim": "adamw_torch_4bit"}, {}, CPU, "train.optim", "adamw_torch_4bit needs the torchao package"),
    ({}, {"attn_implementation": "flash_attention_2"}, GPU, "model.attn_implementation",
     "flash_attention_2 needs the flash_attn package"),
    ({}, {"attn_implementation": "flash_attention_2"}, config.DeviceFacts(packages=frozenset({"flash_attn"})),
     "model.attn_implementation", "flash_attention_2 needs a CUDA GPU"),
    ({"tf32": True}, {}, GPU, "train.tf32", "NVIDIA T4 has no TF32 (needs an Ampere or newer GPU)"),
    ({"activation_offloading": True}, {}, CPU, "train.activation_offloading",
     "moves saved activations from the GPU to host memory and needs a CUDA GPU"),
])
def test_a_combination_the_device_cannot_run_is_one_line_naming_the_key(train, model, facts, key, words):
    cfg = config.from_container({"train": train, "model": model}, source="test")
    with pytest.raises(ConfigError) as e:
        config.check_device(cfg, facts)
    msg = str(e.value)
    assert msg.startswith(f"params.yaml: {key}: ") and words in msg and "\n" not in msg


@pytest.mark.parametrize("train, model, facts", [
    ({"num_processes": 4}, {}, CPU),  # gloo processes on a CPU: any number
    ({"tf32": True}, {}, CPU),  # TF32 is a no-op on a CPU
    ({"bf16": True}, {}, CPU),  # CPU autocast
    ({"num_processes": 2, "fp16": True}, {}, GPU),
    ({"activation_offloading": True}, {}, GPU),
    ({"optim": "adamw_bnb_8bit"}, {"attn_implementation": "flash_attention_2"},
     config.DeviceFacts(cuda=True, gpus=1, packages=frozenset({"bitsandbytes", "flash_attn"}))),
    ({"optim": "adamw_torch_8bit"}, {}, config.DeviceFacts(packages=frozenset({"torchao"}))),  # torchao: CPU too
    ({"optim": "adamw_torch_4bit"}, {}, config.DeviceFacts(packages=frozenset({"torchao"}))),
])
def test_combinations_the_device_runs_pass(train, model, facts):
    config.check_device(config.from_container({"train": train, "model": model}, source="test"), facts)


def test_with_layout_writes_the_micro_batch_in_use_where_a_backend_reads_it():
    cfg = config.from_container({"train": {"per_device_train_batch_size": "auto", "effective_batch_size": 16,
                                           "memory_budget_gib": 1}}, source="test")
    used = config.with_layout(cfg, config.resolve(cfg, micro_batch=4))
    assert (used.train.per_device_train_batch_size, used.train.gradient_accumulation_steps) == (4, 4)
    assert config.resolve(used) == config.Resolved(4, 4, 1) and used.train.effective_batch_size == 16
    assert cfg.train.per_device_train_batch_size == "auto"  # the params as given (logged) stay as they were
    with pytest.raises(ValueError, match="2 processes"):
        config.with_layout(cfg, config.Resolved(4, 2, 2))
