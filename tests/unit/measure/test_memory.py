"""The memory breakdown (onegpu.measure.memory) on the packaged default model."""
from __future__ import annotations

import pytest
import torch

from onegpu.measure import memory
from onegpu.training.objectives.loss import classification_loss
from tests.unit.tiny import low_bit_step


def test_checkpointing_cuts_activation_bytes_at_least_3x_on_the_default_model(minilm):
    model, batch = minilm
    model.activation_checkpointing_disable()
    full = memory.activation_bytes(model, batch, classification_loss)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    try:
        ckpt = memory.activation_bytes(model, batch, classification_loss)
    finally:
        model.activation_checkpointing_disable()
    assert full > 10 * 2**20  # 8 x 64 tokens through 6 layers of 384: tens of MB saved
    assert full / ckpt >= 3.0, (full, ckpt)


def test_activation_probe_leaves_the_rng_and_mode_alone(minilm):
    model, batch = minilm
    model.eval()
    torch.manual_seed(123)
    before = torch.get_rng_state()
    memory.activation_bytes(model, batch, classification_loss)
    assert torch.equal(before, torch.get_rng_state())
    assert not model.training


def test_state_bytes_after_an_adamw_step(minilm):
    model, batch = minilm
    model = type(model)(model.config)  # a fresh copy: this test steps the optimizer
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    classification_loss(model(**inputs), batch["labels"]).backward()
    opt.step()
    b = memory.state_bytes(model, opt)
    n = sum(p.numel() for p in model.parameters())
    assert b["mem_params_bytes"] == 4 * n  # float32, no shared storage in BERT-classification
    assert b["mem_grads_bytes"] == b["mem_params_bytes"]
    assert b["mem_optimizer_bytes"] == 2 * b["mem_params_bytes"]


def test_tensors_bytes_counts_a_storage_once():
    t = torch.zeros(1000)
    assert memory.tensors_bytes([t, t[:10], t.view(10, 100)]) == 4000


@pytest.mark.parametrize("optim,bits,qmap", [("adamw_torch_8bit", 8, 256), ("adamw_torch_4bit", 4, 16)])
def test_state_bytes_count_torchaos_low_bit_states_by_their_storage(optim, bits, qmap):
    """torchao's quantised states are tensor subclasses that look like fp32 tensors of the parameter's shape;
    their bytes are the codes (``bits`` per value), one fp32 scale per block of 256 and an fp32 quantization
    map of ``qmap`` entries, per state (exp_avg and exp_avg_sq). The biases (256 and 64 elements, below
    torchao's 4,096) keep two fp32 states."""
    pytest.importorskip("torchao")
    model, opt = low_bit_step(optim)
    quantised = sum(2 * (n * bits // 8 + 4 * n // 256 + 4 * qmap) for n in (256 * 256, 256 * 64))
    b = memory.state_bytes(model, opt)
    assert b["mem_optimizer_bytes"] == quantised + 2 * 4 * (256 + 64)
    assert b["mem_optimizer_bytes"] == {8: 173056, 4: 87296}[bits]  # fp32 AdamW: 657920
    assert b["mem_params_bytes"] == b["mem_grads_bytes"] == 4 * (256 * 256 + 256 + 256 * 64 + 64)


def test_state_bytes_read_adafactors_factored_moments(minilm):
    from transformers.optimization import Adafactor

    from onegpu.training.memory import autobatch
    model, batch = minilm
    model = type(model)(model.config)
    opt = Adafactor(model.parameters(), lr=1e-4, scale_parameter=False, relative_step=False)  # as Trainer builds it
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    classification_loss(model(**inputs), batch["labels"]).backward()
    opt.step()
    b = memory.state_bytes(model, opt)
    # a row and a column vector per matrix, a full buffer per vector: far below AdamW's 2 x params
    assert 0 < b["mem_optimizer_bytes"] < 0.05 * b["mem_params_bytes"]
    predicted = autobatch.optimizer_state_bytes(model, "adafactor")
    assert abs(predicted - b["mem_optimizer_bytes"]) <= 0.15 * b["mem_optimizer_bytes"]
    assert predicted == b["mem_optimizer_bytes"]  # exact, in fact: the same shapes


def test_bf16_activations_per_micro_batch_are_below_fp32_and_the_weight_copies_have_their_own_line(minilm):
    """MiniLM at 4 x 32 tokens (the default model): under bf16 autocast the bytes saved for backward that
    grow with the micro-batch are ~0.74x of fp32's; autocast's bf16 copy of every matmul weight (2 bytes
    per element, made once per forward and kept for backward) is counted on its own line, exactly."""
    model, batch = minilm
    four = {k: v[:4, :32] for k, v in batch.items() if k != "labels"} | {"labels": batch["labels"][:4]}
    fp32 = memory.activation_bytes(model, four, classification_loss)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = memory.activation_bytes(model, four, classification_loss)
        saved = memory.saved_bytes(model, four, classification_loss)
    assert bf16 == saved["activations"]
    assert 0.6 * fp32 < bf16 < 0.85 * fp32, (bf16, fp32)
    linear_weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert saved["autocast_weights"] == 2 * linear_weights  # every nn.Linear's weight, in bf16
    assert memory.saved_bytes(model, four, classification_loss) == {"activations": fp32, "autocast_weights": 0}


def test_device_facts_name_the_optional_packages_installed(monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "flash_attn"
                        else None if name in ("bitsandbytes", "torchao") else real(name, *a))
    monkeypatch.setattr(memory, "cuda_available", lambda: False)
    facts = memory.device_facts()
    assert facts.packages == frozenset({"flash_attn"}) and not facts.cuda and facts.gpus == 0
