"""bench.vs_trl_grpo's arms on a tiny Llama with the packaged tokenizer: onegpu's GRPO step and TRL's GRPOTrainer
on the same generations and micro-batches (uneven completion lengths, dapo) agree per step in fp32 within 1e-5
(loss, grad_norm, clip_ratio/region_mean), over steps that move the policy."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("trl")

from bench import vs_trl_grpo  # noqa: E402
from onegpu.training.objectives import generation, grpo_batch, reinforcement  # noqa: E402
from tests.unit.equivalence import float64  # noqa: E402


@pytest.fixture(scope="module")
def runs():
    from onegpu.config import LoraConfig
    from onegpu.models import lora
    cfg, _ = float64.grpo_config({"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2,
                                  "max_steps": 3, "learning_rate": 1e-2, "seed": 3})

    def model():  # the job's: LoRA on the same weights, the same adapters
        m, _ = float64.grpo_model(cfg, 2, fused=False, dtype=torch.float32)
        torch.manual_seed(1)
        return lora.apply(m, LoraConfig(r=4, alpha=8.0), "grpo", False)
    tok, data = float64.chat_tokenizer(), float64.grpo_data(6)["train"]
    policy, settings = model(), reinforcement.settings_of(cfg)
    batches = [grpo_batch.build(policy, data["prompt"][2 * s:2 * s + 2], data["prompt_ids"][2 * s:2 * s + 2],
                                {"answer": data["answer"][2 * s:2 * s + 2]}, {"text_reward": float64.text_reward},
                                settings, tok.decode, tok.pad_token_id, generation.eos_ids(tok, policy), 10 + s)
               for s in range(3)]
    digests = [vs_trl_grpo.digest(b) for b in batches]
    out = {}
    try:
        for name in vs_trl_grpo.ARMS:
            out[name] = vs_trl_grpo.train_arm(vs_trl_grpo.Arm(name, model(), cfg, tok, "cpu"), batches, digests)
    finally:  # the GRPOTrainer set Accelerate's one mixed-precision setting per process
        from accelerate.state import AcceleratorState
        AcceleratorState._reset_state(True)
    return out, batches


def test_onegpu_and_trl_train_the_same_grpo_steps_on_the_same_generations(runs):
    runs, batches = runs
    one, trl = runs["onegpu"]["rows"], runs["trl"]["rows"]
    assert len({int(n) for b in batches for n in b.gens.lengths}) > 1  # uneven completions
    for r, s in zip(one, trl):
        assert abs(r["loss"] - s["loss"]) <= 1e-5 * max(abs(s["loss"]), 1e-2), (r, s)
        assert abs(r["grad_norm"] - s["grad_norm"]) <= 1e-5 * s["grad_norm"], (r, s)
        assert abs(r["clip_ratio/region_mean"] - s["clip_ratio/region_mean"]) <= 1e-6, (r, s)
    assert one[2]["grad_norm"] != one[0]["grad_norm"]  # the steps moved the policy


def test_an_arm_refuses_other_generations_than_the_list(runs):
    _, batches = runs
    with pytest.raises(AssertionError, match="other generations than the list"):
        vs_trl_grpo.train_arm(None, batches, ["0" * 16] * 3)
