"""train.fsdp's helpers (onegpu.training.sharding) in this process: which blocks are sharded, the plain skeleton,
the gradient-sync context, the norm, and a one-process FSDP2 round trip (shard, gather into the skeleton).

FSDP2 over 2 gloo processes = 1 process in float64: tests/unit/training/test_distributed.py."""
from __future__ import annotations

import pytest

from onegpu.training import sharding

torch = pytest.importorskip("torch")


def _llama():
    """A 2-layer Llama with tied embeddings and a vocabulary of 64 (no tokenizer to convert)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True))


def test_the_blocks_are_the_models_no_split_modules():
    model = _llama()
    assert [type(b).__name__ for b in sharding.blocks(model)] == ["LlamaDecoderLayer"] * 2
    assert sharding.blocks(torch.nn.Linear(2, 2)) == []  # names none: the root alone


def test_the_skeleton_holds_no_weights_and_keeps_the_ties():
    model = _llama()
    skeleton = sharding.meta_copy(model)
    assert {p.device.type for p in skeleton.parameters()} == {"meta"}
    assert skeleton.lm_head.weight is skeleton.model.embed_tokens.weight
    assert {p.device.type for p in model.parameters()} == {"cpu"}  # the model itself untouched


def test_gradient_sync_is_off_for_the_context_alone():
    calls = []

    class Model:
        def set_requires_gradient_sync(self, on: bool) -> None:
            calls.append(on)

    with sharding.gradient_sync(Model(), sync=True):
        assert calls == []
    with pytest.raises(RuntimeError), sharding.gradient_sync(Model(), sync=False):
        assert calls == [False]
        raise RuntimeError("a failed backward still turns the sync back on")
    assert calls == [False, True]


def test_a_plain_norm_stays_as_it_is():
    norm = torch.tensor(2.5)
    assert sharding.global_norm(norm) is norm


def test_sharding_needs_the_launchs_process_group():
    with pytest.raises(RuntimeError, match="train.fsdp: FSDP2 needs the launch's process group"):
        sharding.shard(torch.nn.Linear(2, 2), "cpu", True)


def test_one_process_shards_and_gathers_the_same_weights(monkeypatch):
    """A gloo group of 1: fully_shard makes every parameter a DTensor; gather puts the whole weights, ties kept,
    into the skeleton (bit-equal)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from tests.unit.training.test_distributed import _free_port
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    model = _llama()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    skeleton = sharding.meta_copy(model)
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        assert sharding.shard(model, "cpu", reshard_after_forward=True) == 2
        assert all(isinstance(p, DTensor) for p in model.parameters())
        plain = sharding.gather(model, skeleton)
    finally:
        dist.destroy_process_group()
    assert plain is skeleton and plain.lm_head.weight is plain.model.embed_tokens.weight
    assert {n: p for n, p in plain.named_parameters()}.keys() == before.keys()
    assert all(torch.equal(p, before[n]) and not isinstance(p, DTensor) for n, p in plain.named_parameters())
