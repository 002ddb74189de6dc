"""Issue 31: each stage declares every param its code reads (tests/unit/test_dvc_yaml.py reads the code),
so a change of one re-runs the stages it acts in. On a text causal-LM job (GPT-2 from config, BBC text,
test_causal_lm.py's params and so its trained copy): every key the params test finds for train and evaluate
makes `dvc status` name that stage (no training)."""
from __future__ import annotations

import pytest
import yaml

from tests.unit.test_dvc_yaml import params_read_by

from .test_causal_lm import CAUSAL

pytestmark = pytest.mark.slow

# A different value for keys whose type alone does not give one that onegpu accepts.
OTHER = {"model.task": "sequence-classification", "model.name_or_path": "gpt2", "model.attn_implementation": "eager",
         "model.lora.target_modules": ["c_attn"], "train.backend": "accelerate", "train.optim": "sgd",
         "train.lr_scheduler_type": "cosine", "train.gradient_checkpointing_blocks": "mlp",
         "train.cpu_allocator": "system", "train.torch_compile_mode": "default", "tracking.experiment_name": "other",
         "train.effective_batch_size": 8, "train.max_steps": 5, "train.memory_budget_gib": 1.5,
         "train.dataloader_pin_memory": True, "data.source": "bbcnews-headlines", "train.eval_strategy": "epoch",
         "train.metric_for_best_model": "eval_mean_token_accuracy", "train.greater_is_better": True,
         "train.dpo.loss_type": ["hinge"], "train.dpo.loss_weights": [0.5], "train.main_process_ip": "10.0.0.1",
         "train.grpo.loss_type": "grpo", "train.grpo.scale_rewards": "batch", "train.grpo.top_p": 0.9,
         "train.grpo.reward_funcs": ["answer_mentioned"], "train.grpo.reward_weights": [2.0]}
# Keys whose other value is valid only with another key changed too (config.validate's combinations): the
# params file that `dvc status` reads changes the key alone, the one onegpu validates both.
COMPANION = {"model.task": {"model.name_or_path": "gpt2"}, "train.torch_compile_mode": {"train.torch_compile": True},
             **{f"train.{k}": {"train.gradient_checkpointing": True} for k in (
                 "gradient_checkpointing_blocks", "gradient_checkpointing_kwargs.every_n_layers",
                 "gradient_checkpointing_kwargs.use_reentrant")},
             "train.num_machines": {"train.main_process_ip": "10.0.0.1", "train.num_processes": 2},
             "train.machine_rank": {"train.num_machines": 2, "train.main_process_ip": "10.0.0.1",
                                    "train.num_processes": 2},
             "train.fsdp.enabled": {"train.backend": "accelerate", "train.num_processes": 2,
                                    "train.eval_strategy": "no", "train.oom_retry": False,
                                    "train.fused_lm_head": False}}


def _other(key: str, value):
    """A value of ``key`` other than ``value`` (onegpu accepts it: the test validates it)."""
    if key in OTHER:
        return OTHER[key]
    if isinstance(value, bool) or value is None:
        return not value if isinstance(value, bool) else 10  # the null keys left are counts of steps
    if isinstance(value, (int, float)):
        return value * 2 if value else (1 if isinstance(value, int) else 0.1)
    raise AssertionError(f"no other value for {key}: {value!r}")


def _leaves(params: dict, key: str) -> dict:
    """``key``'s value in ``params`` by dotted key, or each key under it when it names a mapping."""
    value = params
    for part in key.split("."):
        value = value[part]
    if not isinstance(value, dict):
        return {key: value}
    return {k: v for sub in value for k, v in _leaves(params, f"{key}.{sub}").items()}


def _set(params: dict, key: str, value) -> dict:
    out = yaml.safe_load(yaml.safe_dump(params))
    *path, last = key.split(".")
    node = out
    for part in path:
        node = node[part]
    node[last] = value
    return out


def _changed_stages(project) -> set[str]:
    """The stages `dvc status` names (DVC's API in this process: a fraction of the command's start-up)."""
    from dvc.repo import Repo
    with Repo(str(project)) as repo:
        return {name.rsplit(":", 1)[-1] for name in repo.status()}


@pytest.fixture(scope="module")
def causal(tmp_path_factory, trained):
    """A copy of the causal-LM project on which `dvc repro` ran once per session (test_causal_lm.py's too)."""
    return trained(tmp_path_factory.mktemp("causal"), CAUSAL)


def test_every_key_a_stage_reads_makes_dvc_status_name_it(causal):
    """The front door's retrain trigger for every key, data.padding_free and data.packing among them (they
    used to re-run prepare alone, so `dvc exp run -S data.padding_free=true` showed the old training under
    the new value): `dvc exp run` re-runs the stages `dvc status` names, so no experiment is trained here.
    What the retrain gives is proven more cheaply: packing another training (another equivalence key),
    padding-free the same one (tests/unit/equivalence/test_key.py::
    test_packing_is_another_training_and_padding_free_the_same)."""
    from onegpu import config
    params_file = causal / "params.yaml"
    text = params_file.read_text()
    params = yaml.safe_load(text)
    assert _changed_stages(causal) == set()
    keys = {}
    for stage in ("reference", "train", "evaluate"):
        for read in params_read_by(stage):
            for key in _leaves(params, read):
                keys.setdefault(key, set()).add(stage)
    assert {"data.padding_free", "data.packing"} <= {k for k, s in keys.items() if "train" in s}
    missed = {}
    try:
        for key, stages in sorted(keys.items()):
            value = _other(key, _leaves(params, key)[key])
            changed = _set(params, key, value)
            both = changed
            for other, companion in COMPANION.get(key, {}).items():
                both = _set(both, other, companion)
            config.from_container(both, key)
            params_file.write_text(yaml.safe_dump(changed, sort_keys=False))
            if stages - (named := _changed_stages(causal)):
                missed[key] = (value, named)
    finally:
        params_file.write_text(text)
    assert missed == {}, f"these keys, set as shown, left their stage up to date: {missed}"
    assert _changed_stages(causal) == set()


def test_the_reference_stage_runs_again_for_what_decides_its_scores_alone(causal):
    """DPO's precomputed reference (the reference stage) is scored again when the model, the data or a param
    of :data:`onegpu.training.objectives.precomputed.PARAMS` changes, not for a sweep of the learning rate, beta, the
    split or the LoRA rank: those re-run train alone (and evaluate)."""
    params_file = causal / "params.yaml"
    text = params_file.read_text()
    params = yaml.safe_load(text)
    named = {}
    try:
        for key, value in (("train.learning_rate", 1e-3), ("train.dpo.beta", 0.2), ("model.lora.r", 4),
                           ("train.per_device_train_batch_size", 2), ("train.seed", 7), ("data.max_length", 32)):
            params_file.write_text(yaml.safe_dump(_set(params, key, value), sort_keys=False))
            named[key] = "reference" in _changed_stages(causal)
    finally:
        params_file.write_text(text)
    assert named == {"train.learning_rate": False, "train.dpo.beta": False, "model.lora.r": False,
                     "train.per_device_train_batch_size": False, "train.seed": True, "data.max_length": True}
