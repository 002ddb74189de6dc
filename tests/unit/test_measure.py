"""The memory breakdown (onegpu.measure) and FLOPs (onegpu.flops) on the packaged default model."""
from __future__ import annotations

import pytest
import torch

from onegpu import flops, measure, models
from onegpu.training.loss import classification_loss


@pytest.fixture(scope="module")
def minilm():
    models.go_offline()
    path = models.resolve_model_path("packaged:all-MiniLM-L6-v2")
    tok = models.load_tokenizer(path, "sequence-classification")
    torch.manual_seed(0)
    model = models.build_classifier(path, ["a", "b", "c", "d", "e"], dropout=None)
    texts = [("word " * n).strip() for n in (60, 40, 64, 10, 50, 64, 30, 64)]
    batch = dict(tok(texts, truncation=True, max_length=64, padding=True, return_tensors="pt"))
    batch["labels"] = torch.tensor([0, 1, 2, 3, 4, 0, 1, 2])
    return model, batch


def test_checkpointing_cuts_activation_bytes_at_least_3x_on_the_default_model(minilm):
    model, batch = minilm
    model.activation_checkpointing_disable()
    full = measure.activation_bytes(model, batch, classification_loss)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    try:
        ckpt = measure.activation_bytes(model, batch, classification_loss)
    finally:
        model.activation_checkpointing_disable()
    assert full > 10 * 2**20  # 8 x 64 tokens through 6 layers of 384: tens of MB saved
    assert full / ckpt >= 3.0, (full, ckpt)


def test_activation_probe_leaves_the_rng_and_mode_alone(minilm):
    model, batch = minilm
    model.eval()
    torch.manual_seed(123)
    before = torch.get_rng_state()
    measure.activation_bytes(model, batch, classification_loss)
    assert torch.equal(before, torch.get_rng_state())
    assert not model.training


def test_state_bytes_after_an_adamw_step(minilm):
    model, batch = minilm
    model = type(model)(model.config)  # a fresh copy: this test steps the optimizer
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    classification_loss(model(**inputs), batch["labels"]).backward()
    opt.step()
    b = measure.state_bytes(model, opt)
    n = sum(p.numel() for p in model.parameters())
    assert b["mem_params_bytes"] == 4 * n  # float32, no shared storage in BERT-classification
    assert b["mem_grads_bytes"] == b["mem_params_bytes"]
    assert b["mem_optimizer_bytes"] == 2 * b["mem_params_bytes"]


def test_tensors_bytes_counts_a_storage_once():
    t = torch.zeros(1000)
    assert measure.tensors_bytes([t, t[:10], t.view(10, 100)]) == 4000


def test_flops_per_token_follows_6n_plus_attention(minilm):
    model, _ = minilm
    n = flops.non_embedding_parameters(model)
    # MiniLM-L6: 6 layers x (4 x 384^2 attention + 2 x 384 x 1536 MLP + biases/norms) ~ 10.6 M
    assert 10.0e6 < n < 11.5e6
    assert flops.flops_per_token(model, 64) == 6 * n + 12 * 6 * 384 * 64


def test_device_peak_uses_the_datasheet_for_known_gpus_and_measures_a_cpu():
    assert flops.device_peak("NVIDIA H200", "bf16", "cuda:0") == (989e12, "datasheet")
    peak, source = flops.device_peak("cpu", "fp32", "cpu")
    assert source == "measured" and 1e8 < peak < 1e14
