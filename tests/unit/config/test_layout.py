"""onegpu.config.layout: dotted names and the batch layout a backend reads."""
from __future__ import annotations

import pytest

from onegpu import config

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


def test_with_layout_writes_the_micro_batch_in_use_where_a_backend_reads_it():
    cfg = config.from_container({"train": {"per_device_train_batch_size": "auto", "effective_batch_size": 16,
                                           "memory_budget_gib": 1}}, source="test")
    used = config.with_layout(cfg, config.resolve(cfg, micro_batch=4))
    assert (used.train.per_device_train_batch_size, used.train.gradient_accumulation_steps) == (4, 4)
    assert config.resolve(used) == config.Resolved(4, 4, 1) and used.train.effective_batch_size == 16
    assert cfg.train.per_device_train_batch_size == "auto"  # the params as given (logged) stay as they were
    with pytest.raises(ValueError, match="2 processes"):
        config.with_layout(cfg, config.Resolved(4, 2, 2))
