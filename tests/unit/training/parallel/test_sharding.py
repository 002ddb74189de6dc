"""train.fsdp's helpers (onegpu.training.parallel.sharding) in this process: which blocks are sharded, the plain
skeleton, the gradient-sync context, the norm, and a one-process FSDP2 round trip (shard, gather into the skeleton).

FSDP2 over 2 gloo processes = 1 process in float64: tests/unit/training/parallel/test_distributed.py."""
from __future__ import annotations

import pytest

from onegpu.training.parallel import sharding

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

    from tests.unit.training.parallel.test_distributed import _free_port
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


# The tiny Llama's tensors (shape): per layer q (16, 16), k and v (8, 16), o (16, 16), gate and up (24, 16), down
# (16, 24), two norms (16,): 1,952 elements; the root: the tied embedding (64, 16) and the final norm (16,): 1,040.
LAYER, ROOT = 256 + 128 + 128 + 256 + 384 + 384 + 384 + 2 * 16, 64 * 16 + 16
# Over 3 ranks each tensor's shard is ceil(dim0 / 3) rows: q 6 x 16, k and v 3 x 16, o 6 x 16, gate and up 8 x 16,
# down 6 x 24, the norms 6 each; the embedding 22 x 16, the final norm 6.
LAYER_3, ROOT_3 = 96 + 48 + 48 + 96 + 128 + 128 + 144 + 2 * 6, 22 * 16 + 6


def test_per_rank_bytes_are_the_padded_dim0_shards_plus_two_gathered_blocks_and_the_root():
    model = _llama()
    assert LAYER == 1952 and ROOT == 1040 and sum(p.numel() for p in model.parameters()) == 2 * LAYER + ROOT
    got = sharding.per_rank_bytes(model, processes=3, accumulation=1, optim="adamw_torch")
    shard = 4 * (2 * LAYER_3 + ROOT_3)  # fp32: 7,032 bytes
    assert got == {"mem_params_bytes": shard, "mem_grads_bytes": shard, "mem_optimizer_bytes": 2 * shard,
                   "mem_gathered_bytes": 4 * (2 * LAYER + ROOT)}
    assert shard == 7032
    # accumulation: every gradient whole (unsharded) until the step's last micro-batch
    accumulating = sharding.per_rank_bytes(model, processes=3, accumulation=2, optim="adamw_torch")
    assert accumulating == {**got, "mem_grads_bytes": 4 * (2 * LAYER + ROOT)}
    # 2 ranks divide every dim 0: exactly half; Adafactor's factored states of each shard's shape
    half = sharding.per_rank_bytes(model, processes=2, accumulation=1, optim="adafactor")
    assert half["mem_params_bytes"] == 4 * (2 * LAYER + ROOT) // 2
    assert half["mem_optimizer_bytes"] == 4 * (2 * (8 + 16 + 4 + 16 + 4 + 16 + 8 + 16 + 12 + 16 + 12 + 16 + 8 + 24
                                                    + 8 + 8) + 32 + 16 + 8)


def test_without_resharding_every_blocks_gathered_weights_stay_and_frozen_weights_have_no_grads():
    model = _llama()
    kept = sharding.per_rank_bytes(model, processes=3, accumulation=1, optim="adamw_torch",
                                   reshard_after_forward=False)
    assert kept["mem_gathered_bytes"] == 4 * (2 * LAYER + ROOT)  # the whole params, at the end of the forward
    model.model.embed_tokens.weight.requires_grad_(False)
    frozen = sharding.per_rank_bytes(model, processes=3, accumulation=1, optim="adamw_torch")
    assert frozen["mem_params_bytes"] == 4 * (2 * LAYER_3 + ROOT_3)
    assert frozen["mem_grads_bytes"] == 4 * (2 * LAYER_3 + 6)  # the final norm's shard alone in the root
    assert frozen["mem_optimizer_bytes"] == 8 * (2 * LAYER_3 + 6)
    model.model.layers[1].mlp.down_proj.weight.data = torch.zeros(16, 48)  # one block larger than the other
    bigger = sharding.per_rank_bytes(model, processes=3, accumulation=1, optim="adamw_torch")
    assert bigger["mem_gathered_bytes"] == 4 * (LAYER + LAYER + 16 * 24 + ROOT)  # the two blocks, not 2 x the larger
    with pytest.raises(ValueError, match="processes and accumulation must be >= 1"):
        sharding.per_rank_bytes(model, processes=0, accumulation=1, optim="adamw_torch")


def test_the_estimate_per_rank_swaps_the_states_and_keeps_the_activations():
    """Each micro-batch's total: the whole model's states out, one rank's and the gathered weights in; under
    per_device_train_batch_size auto a micro-batch that needs accumulation holds the whole gradients."""
    from onegpu import config
    from tests import defaults
    model = _llama()
    whole = {"mem_params_bytes": 100, "mem_grads_bytes": 100, "mem_optimizer_bytes": 200}
    est = {"states": whole, "autocast_weights": 0, "length": 8,
           "rows": [{"micro_batch": m, "activations": 1000 * m, "activations_checkpointed": 10 * m, "logits": 0,
                     "total": 400 + 1000 * m} for m in (1, 2)]}
    raw = defaults.params()
    raw["train"].update(backend="accelerate", num_processes=2, eval_strategy="no", oom_retry=False,
                        per_device_train_batch_size="auto", effective_batch_size=4, fsdp={"enabled": True})
    train = config.from_container(raw).train
    got = sharding.per_rank_estimate(model, est, train)
    at = [sharding.per_rank_bytes(model, 2, accumulation, "adamw_torch") for accumulation in (2, 1)]
    assert [r["total"] for r in got["rows"]] == [sum(at[0].values()) + 1000, sum(at[1].values()) + 2000]
    assert [r["activations"] for r in got["rows"]] == [1000, 2000]
    assert got["ranks"] == 2 and got["grads_accumulating"] and got["mem_gathered_bytes"] == at[0]["mem_gathered_bytes"]
    assert got["states"] == {k: v for k, v in at[0].items() if k != "mem_gathered_bytes"}
