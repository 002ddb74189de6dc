"""onegpu.config.grpo: train.grpo with TRL's GRPOConfig names and defaults; a GRPO run's step holds whole groups
(TRL's rule); what a GRPO run does not combine with yet refused in one line naming the key, exit 2, before any
work."""
from __future__ import annotations

import pytest

from onegpu import config
from onegpu.errors import ConfigError


def grpo(**train):
    return config.from_container({"model": {"task": "grpo", "name_or_path": None},
                                  "data": {"source": "prompts.jsonl"},
                                  "train": {"per_device_train_batch_size": 8, **train}}, source="params")


def test_trls_defaults_and_a_default_run_validates():
    g = grpo().train.grpo
    assert (g.num_generations, g.max_completion_length, g.temperature, g.loss_type, g.epsilon, g.epsilon_high,
            g.beta, g.scale_rewards, g.num_iterations, g.reward_funcs) == (8, 256, 1.0, "dapo", 0.2, None, 0.0,
                                                                            "group", 1, ["correctness"])
    assert grpo().train.metric_for_best_model == "eval_loss"  # the default stands, unused (no eval_loss here)


@pytest.mark.parametrize("train,key,words", [
    ({"per_device_train_batch_size": 6}, "train.grpo.num_generations", "6 x 1 x 1 = 6 completions"),
    ({"per_device_train_batch_size": "auto", "effective_batch_size": 16}, "train.per_device_train_batch_size",
     "give an integer"),
    ({"num_processes": 2}, "train.num_processes", "set train.num_processes: 1"),
    ({"torch_compile": True}, "train.torch_compile", "set train.torch_compile: false"),
    ({"grpo": {"beta": 0.04}}, "train.grpo.beta", "set train.grpo.beta: 0"),
    ({"grpo": {"num_iterations": 2}}, "train.grpo.num_iterations", "set train.grpo.num_iterations: 1"),
    ({"grpo": {"reward_weights": [1.0, 2.0]}}, "train.grpo.reward_weights", "2 weights for 1 reward functions"),
    ({"grpo": {"loss_type": "sapo"}}, "train.grpo.loss_type", "dapo"),
    ({"grpo": {"num_generations": 1}}, "train.grpo.num_generations", "at least 2"),
    ({"metric_for_best_model": "eval_loss", "load_best_model_at_end": True}, "train.metric_for_best_model",
     "use one of eval_pass_rate"),
], ids=["not-whole-groups", "auto", "processes", "compile", "beta", "iterations", "weights", "loss-type",
        "one-generation", "best-by-eval-loss"])
def test_what_a_grpo_run_does_not_combine_with_is_one_line(train, key, words):
    with pytest.raises(ConfigError) as e:
        grpo(**train)
    message = str(e.value)
    assert message.startswith(f"params: {key}") and words in message and "\n" not in message, message


def test_padding_free_is_refused_for_grpo_and_not_for_other_tasks():
    with pytest.raises(ConfigError, match="data.padding_free: is True with model.task: grpo"):
        config.from_container({"model": {"task": "grpo", "name_or_path": None},
                               "data": {"source": "prompts.jsonl", "padding_free": True}}, source="params")
    config.from_container({"model": {"task": "causal-lm", "name_or_path": None},
                           "data": {"source": "x.jsonl", "padding_free": True}, "train": {"grpo": {"beta": 0.1}}},
                          source="params")  # train.grpo unused outside GRPO
