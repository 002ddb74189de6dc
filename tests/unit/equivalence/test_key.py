"""The equivalence key (onegpu.equivalence.key): what it ignores, what changes it, its pinned value."""
from __future__ import annotations

import copy
import re

import pytest

from onegpu import config
from onegpu.equivalence import key as eqkey
from tests import defaults


@pytest.fixture
def raw() -> dict:
    """The repo's committed params.yaml as a plain dict (a fresh copy per test)."""
    return defaults.params()


# A fixed, complete params dict (the repo's params.yaml as written when the key was pinned). The pinned
# equivalence key below is computed from this, not from params.yaml, so editing params.yaml (or
# `dvc exp run -S`, which rewrites it) never breaks the pin; changing the key's definition or the schema
# does.
PINNED = {
    "data": {"source": "bbcnews", "text_column": "text", "label_column": "label", "max_length": 64,
             "validation_size": 0.1, "test_size": 0.2, "max_train_samples": 500, "max_eval_samples": None,
             "seed": 42},
    "model": {"task": "sequence-classification", "name_or_path": "packaged:all-MiniLM-L6-v2",
              "dropout": None},
    "train": {"backend": "trainer", "per_device_train_batch_size": 8, "gradient_accumulation_steps": 2,
              "effective_batch_size": None, "memory_budget_gib": None, "gradient_checkpointing": False,
              "learning_rate": 1.0e-4, "num_train_epochs": 1, "max_steps": -1, "warmup_ratio": 0.0,
              "lr_scheduler_type": "linear", "weight_decay": 0.0, "optim": "adamw_torch",
              "max_grad_norm": 1.0, "seed": 42, "bf16": False, "fp16": False, "logging_steps": 10,
              "dataloader_num_workers": 0},
    "evaluate": {"per_device_eval_batch_size": 64},
    "tracking": {"experiment_name": "onegpu"},
}
PINNED_KEY = "b029d38e93bebdf3"  # equivalence_key(from_container(PINNED), resolve(...), "abc")


# -- the key -----------------------------------------------------------------------------

def _key(raw: dict, fingerprint: str = "abc", **train) -> str:
    d = copy.deepcopy(raw)
    d["train"]["effective_batch_size"] = None
    d["train"].update(train)
    cfg = config.from_container(d)
    return eqkey.equivalence_key(cfg, config.resolve(cfg), fingerprint)


def test_equivalence_key_ignores_how_the_batch_is_split(raw):
    a = _key(raw, per_device_train_batch_size=4, gradient_accumulation_steps=4)
    b = _key(raw, per_device_train_batch_size=16, gradient_accumulation_steps=1)
    c = _key(raw, per_device_train_batch_size=8, gradient_accumulation_steps=2, gradient_checkpointing=True,
             logging_steps=1)
    assert a == b == c


def test_equivalence_key_ignores_observation_only_params(raw):
    base = _key(raw)
    d = copy.deepcopy(raw)
    d["tracking"]["experiment_name"] = "other"
    d["evaluate"]["per_device_eval_batch_size"] = 3
    d["data"]["max_eval_samples"] = 11
    d["train"]["dataloader_num_workers"] = 2
    d["train"]["effective_batch_size"] = None
    assert _key(d) == base


@pytest.mark.parametrize("change", [
    {"tf32": True}, {"torch_compile": True}, {"torch_compile": True, "torch_compile_mode": "max-autotune"},
    {"dataloader_pin_memory": True}, {"dataloader_pin_memory": False}, {"torch_empty_cache_steps": 2},
    {"optim": "adamw_torch_fused"}, {"cpu_allocator": "system"},
])
def test_equivalence_key_ignores_precision_and_kernel_knobs(raw, change):
    # the same mathematics in another precision or kernel: one key, compared within that precision
    assert _key(raw, **{"optim": "adamw_torch", **change}) == _key(raw, optim="adamw_torch")
    for k, v in change.items():  # each with its written reason
        assert f"train.{k}" in eqkey.NOT_IN_EQUIVALENCE_KEY or (f"train.{k}", v) in eqkey.SAME_AS_IN_KEY


@pytest.mark.parametrize("attn", ["eager", "sdpa", "flash_attention_2"])
def test_equivalence_key_ignores_the_attention_kernel(raw, attn):
    d = copy.deepcopy(raw)
    d["model"]["attn_implementation"] = attn
    assert _key(d) == _key(raw)
    assert "model.attn_implementation" in eqkey.NOT_IN_EQUIVALENCE_KEY


@pytest.mark.parametrize("optim", ["adafactor", "adamw_bnb_8bit", "adamw_torch_8bit", "adamw_torch_4bit", "sgd"])
def test_another_optimizer_is_another_training(raw, optim):
    assert _key(raw, optim=optim) != _key(raw, optim="adamw_torch")


@pytest.mark.parametrize("change", [
    {"learning_rate": 3e-4},
    {"seed": 7},
    {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2},
    {"max_steps": 5},
    {"bf16": True},
])
def test_equivalence_key_changes_with_the_mathematics(raw, change):
    base = _key(raw, per_device_train_batch_size=4, gradient_accumulation_steps=4)
    assert _key(raw, **{"per_device_train_batch_size": 4, "gradient_accumulation_steps": 4, **change}) != base


def test_equivalence_key_effective_batch_4x2_vs_4x4_differs(raw):
    assert (_key(raw, per_device_train_batch_size=4, gradient_accumulation_steps=2)
            != _key(raw, per_device_train_batch_size=4, gradient_accumulation_steps=4))


def test_equivalence_key_changes_with_dropout_and_data(raw):
    base = _key(raw)
    d = copy.deepcopy(raw)
    d["model"]["dropout"] = 0.0  # null (the model's own) and 0.0 are different trainings
    assert _key(d) != base
    d = copy.deepcopy(raw)
    d["model"]["dropout"] = 0.2
    assert _key(d) != base
    d = copy.deepcopy(raw)
    d["data"]["max_train_samples"] = 100
    assert _key(d) != base
    assert _key(raw, fingerprint="abd") != base


def test_packing_is_another_training_and_padding_free_the_same(raw):
    """A causal LM's data.packing puts other examples in each micro-batch and step: another key, also over
    a padding-free run (as `dvc exp run -S data.packing=true` from one); data.padding_free flattens the same
    micro-batches: the same key. (That each retrains: tests/integration/test_params_follow_stages.py.)"""
    d = copy.deepcopy(raw)
    d["model"].update(task="causal-lm", name_or_path=None)

    def key(**data) -> str:
        changed = copy.deepcopy(d)
        changed["data"].update(data)
        return _key(changed)
    assert key(padding_free=True) == key(padding_free=False) == key()
    assert key(packing=True) != key()
    assert key(padding_free=True, packing=True) != key(padding_free=True)
    assert "data.padding_free" in eqkey.NOT_IN_EQUIVALENCE_KEY and "data.packing" not in eqkey.NOT_IN_EQUIVALENCE_KEY


def test_equivalence_key_changes_with_world_size(raw):
    cfg = config.from_container(raw)
    assert (eqkey.equivalence_key(cfg, config.resolve(cfg, 1), "abc")
            != eqkey.equivalence_key(cfg, config.resolve(cfg, 2), "abc"))


def test_equivalence_key_is_16_hex_and_pinned():
    cfg = config.from_container(copy.deepcopy(PINNED))
    key = eqkey.equivalence_key(cfg, config.resolve(cfg), "abc")
    assert re.fullmatch(r"[0-9a-f]{16}", key)
    assert key == eqkey.equivalence_key(config.from_container(copy.deepcopy(PINNED)), config.resolve(cfg), "abc")
    assert key == PINNED_KEY


def test_the_default_runs_key_is_unchanged_by_the_lora_mapping_and_the_added_keys():
    """params.yaml now spells LoRA off as the mapping with r: 0 and lists train.oom_retry and
    train.save_steps at their defaults (so `-S` can set them): the key of the default run is the pinned
    one, as with `model.lora: null` and those keys left out."""
    raw = copy.deepcopy(PINNED)
    raw["model"]["lora"] = {"r": 0, "alpha": 16, "dropout": 0.0, "target_modules": None}
    raw["train"].update(oom_retry=True, save_steps=None)
    cfg = config.from_container(raw)
    assert eqkey.equivalence_key(cfg, config.resolve(cfg), "abc") == PINNED_KEY
    pinned = config.from_container(copy.deepcopy(PINNED))
    assert eqkey.run_config_hash(cfg, "abc") == eqkey.run_config_hash(pinned, "abc")


def test_sharding_is_the_same_training_and_checkpoints_are_named_by_the_effective_batch():
    """train.fsdp (FSDP2) is out of the equivalence key and of the run-config hash: a sharded run has the key and the
    checkpoints of the data-parallel run. The hash holds the effective batch instead of its split: 2 processes of
    8 x 2, 4 of 4 x 2 and 1 of 8 x 4 share it (a checkpoint resumes on any of them); 4 processes of 8 x 2 do not."""
    raw = copy.deepcopy(PINNED)
    raw["train"].update(backend="accelerate", num_processes=2, eval_strategy="no", oom_retry=False)
    plain = config.from_container(copy.deepcopy(raw))
    raw["train"]["fsdp"] = {"enabled": True, "reshard_after_forward": False}
    sharded = config.from_container(raw)
    for cfg in (plain, sharded):
        assert not any(k.startswith("train.fsdp") for k in eqkey.equivalence_fields(cfg, config.resolve(cfg), "abc"))
    assert eqkey.equivalence_key(sharded, config.resolve(sharded), "abc") == \
        eqkey.equivalence_key(plain, config.resolve(plain), "abc")
    assert eqkey.run_config_hash(sharded, "abc") == eqkey.run_config_hash(plain, "abc")

    def split(processes: int, micro: int, accum: int):
        return config.from_container({**raw, "train": {**raw["train"], "num_processes": processes,
                                                         "per_device_train_batch_size": micro,
                                                         "gradient_accumulation_steps": accum,
                                                         "fsdp": {"enabled": processes > 1}}})
    same = [split(2, 8, 2), split(4, 4, 2), split(1, 8, 4)]
    assert {eqkey.effective_batch(c) for c in same} == {32} and eqkey.effective_batch(split(4, 8, 2)) == 64
    assert len({eqkey.run_config_hash(c, "abc") for c in same}) == 1
    assert eqkey.run_config_hash(split(4, 8, 2), "abc") != eqkey.run_config_hash(same[0], "abc")


def test_equivalence_fields_hold_resolved_batch_and_fingerprint():
    cfg = config.from_container(copy.deepcopy(PINNED))
    f = eqkey.equivalence_fields(cfg, config.resolve(cfg), "abc")
    assert f["resolved.effective_batch_size"] == 16
    assert f["data.fingerprint"] == "abc"
    assert f["train.learning_rate"] == 1e-4
    for k in eqkey.NOT_IN_EQUIVALENCE_KEY:
        assert k not in f


def test_resolved_params_name_the_layout():
    cfg = config.from_container(copy.deepcopy(PINNED))
    assert eqkey.resolved_params(config.resolve(cfg, 2)) == {
        "resolved.per_device_train_batch_size": 8, "resolved.gradient_accumulation_steps": 2,
        "resolved.effective_batch_size": 32, "resolved.world_size": 2}


@pytest.mark.parametrize("loss_type,same", [("dapo", True), ("grpo", True), ("bnpo", False)])
def test_grpos_split_is_the_same_training_but_under_bnpo(raw, loss_type, same):
    """dapo, dr_grpo and grpo divide by the step's counts (test_same_training_grpo.py proves 8 x 1 = 2 x 4);
    TRL's bnpo averages micro-batch token means, so another split is another training: in its key."""
    raw["model"].update(task="grpo", name_or_path=None)
    raw["data"]["source"] = "bbcnews-sections"
    raw["train"]["grpo"] = {"num_generations": 4, "loss_type": loss_type}
    a = _key(raw, per_device_train_batch_size=8, gradient_accumulation_steps=1)
    b = _key(raw, per_device_train_batch_size=2, gradient_accumulation_steps=4)
    assert (a == b) is same
