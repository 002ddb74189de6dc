"""onegpu.config.device: what this machine cannot run is one line naming the key."""
from __future__ import annotations

import pytest

from onegpu import config
from onegpu.errors import ConfigError

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
