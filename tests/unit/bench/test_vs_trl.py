"""bench.vs_trl's arms on a tiny Llama: the same micro-batch gives the same loss and gradients through
onegpu's whole logits, onegpu's fused head and TRL's fused head, and the bytes each saves for backward are
measured through the same probe (the whole logits' the most)."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from bench import vs_trl  # noqa: E402
from onegpu.training.objectives import lm_head  # noqa: E402
from tests.unit.training.objectives import test_batches as tb  # noqa: E402


def _arm(arm: str):
    from onegpu.models import loader
    model = tb.tiny_llama().train()
    loader.no_kv_cache(model)  # as bench.vs_trl.build and training: a KV cache would join a flattened row's sequences
    if arm == "fused":
        lm_head.attach(model)
    elif arm == "trl":
        from trl.trainer.utils import add_fused_lm_head
        add_fused_lm_head(model, outputs=("log_probs", "entropy", "is_top1"))
    return model


def test_the_three_arms_give_one_loss_and_gradient_and_the_whole_logits_save_the_most():
    from onegpu.training.objectives import model_inputs
    from onegpu.training.objectives.batches import PaddingFreeCollator
    rows = model_inputs(tb.dataset(), "causal-lm")["train"]
    mb = PaddingFreeCollator()([rows[i] for i in range(4)])
    assert vs_trl.digest(mb) == vs_trl.digest(PaddingFreeCollator()([rows[i] for i in range(4)]))
    assert vs_trl.digest(mb) != vs_trl.digest(PaddingFreeCollator()([rows[i] for i in range(1, 5)]))
    out = {}
    for arm in vs_trl.ARMS:
        model = _arm(arm)
        loss = vs_trl.loss_of(arm, model, mb, torch.tensor(40))
        loss.backward()
        out[arm] = (loss.item(), torch.cat([p.grad.flatten() for p in model.parameters()]),
                    vs_trl.saved_bytes(arm, model, mb))
    for arm in ("whole", "trl"):
        assert out[arm][0] == pytest.approx(out["fused"][0], rel=1e-5), arm
        torch.testing.assert_close(out[arm][1], out["fused"][1], rtol=1e-4, atol=1e-6)
    targets, vocab = int(mb["labels"][:, 1:].ne(-100).sum()), tb.tiny_llama().config.vocab_size
    # the whole logits keep at least a float32 log-softmax over every position; the fused heads no vocab-wide tensor
    assert out["whole"][2] - out["fused"][2] >= (mb["input_ids"].shape[1] - 1) * vocab * 4
    assert abs(out["trl"][2] - out["fused"][2]) < targets * vocab * 4


def test_under_bf16_autocast_the_arms_agree_within_bf16():
    from onegpu.training.objectives import model_inputs
    from onegpu.training.objectives.batches import PaddingFreeCollator
    rows = model_inputs(tb.dataset(), "causal-lm")["train"]
    mb = PaddingFreeCollator()([rows[i] for i in range(4)])
    losses = {}
    for arm in vs_trl.ARMS:
        loss = vs_trl.loss_of(arm, _arm(arm), mb, torch.tensor(40), bf16=True)
        assert loss.dtype == torch.float32 or arm != "fused"
        losses[arm] = loss.item()
    fp32 = vs_trl.loss_of("fused", _arm("fused"), mb, torch.tensor(40)).item()
    assert losses["whole"] == pytest.approx(losses["fused"], rel=1e-2)
    assert losses["trl"] == pytest.approx(losses["fused"], rel=1e-2)
    assert losses["fused"] != fp32 and losses["fused"] == pytest.approx(fp32, rel=2e-2)  # bf16 matmuls: not fp32's


def test_model_option_names_the_directory_and_full_finetuning_validates(tmp_path):
    import argparse
    import json
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2,
                                                      "hidden_size": 64, "vocab_size": 49152}))
    args = argparse.Namespace(model=str(tmp_path), max_length=64, rows=8, micro=2, accum=1, steps=1, lr=1e-3, lora=0)
    name = f"{tmp_path.name} (LlamaForCausalLM, 2 layers, hidden 64, vocabulary 49152)"
    assert vs_trl.model_name(args, tmp_path) == name
    (tmp_path / "RANDOM_INIT.txt").write_text("random\n")
    assert vs_trl.model_name(args, tmp_path).endswith("vocabulary 49152, random init)")
    cfg = vs_trl.sft_cfg(args)  # lora 0: every weight trains (no LoRA mapping with alpha 0)
    assert cfg.model.lora_adapters is None and cfg.model.name_or_path == str(tmp_path)
    args.model = vs_trl.PACKAGED
    assert vs_trl.model_name(args, tmp_path) == "SmolLM2-135M-Instruct"
