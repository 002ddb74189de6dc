"""onegpu.config.loading: params.yaml read, -S overrides merged, and every type error one line naming the key."""
from __future__ import annotations

import re

import pytest
import yaml

from onegpu import config
from onegpu.errors import ConfigError
from tests import defaults

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
