"""onegpu's GRPO step against TRL 1.16's GRPOTrainer._compute_loss on the same generations (ours, fed to
both), the same old-policy and reference log-probabilities and the same micro-batches: the loss, the
gradient and TRL's figures (kl, clip_ratio/*) within 1e-5 in float32, for dapo, dr_grpo, grpo and bnpo over
micro-batches of equal size (where TRL's per-micro-batch normalisation agrees with the whole step's: the
tiny random model never samples EOS, so every completion runs to max_completion_length and micro-batches of
equal size hold equal tokens; the splits where the two differ are test_grpo_batch's)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from onegpu.training.objectives import generation, grpo_batch

pytest.importorskip("trl")
PROMPTS = ["What is 2 + 3?", "Name a colour."]
TOL = 1e-5


def length_reward(prompts, completions, **columns):
    return [(len(c) % 3) / 2 for c in completions]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    from tests.unit.training.objectives.test_batches import tokenizer
    tok = tokenizer()
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                      pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    policy, reference = LlamaForCausalLM(cfg), LlamaForCausalLM(cfg)
    # bf16=False: TRL's configs default to bf16 autocast, which on this CPU moves log-probs by ~1e-3.
    # beta 0 at construction (TRL would load a reference from the hub); the KL's beta is set after.
    args = GRPOConfig(output_dir=str(tmp_path_factory.mktemp("trl")), per_device_train_batch_size=8,
                      num_generations=4, max_completion_length=6, temperature=0.9, beta=0.0, epsilon_high=0.28,
                      report_to=[], use_cpu=True, bf16=False)
    trainer = GRPOTrainer(model=policy, reward_funcs=[length_reward], args=args,
                          train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=tok)
    trainer.beta = 0.04
    ids = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True,
                                   return_dict=False) for p in PROMPTS]
    settings = grpo_batch.Settings(sampling=generation.Sampling(4, 6, 0.9), beta=0.04, epsilon_high=0.28,
                                   num_iterations=2)
    batch = grpo_batch.build(trainer.model, PROMPTS, ids, {}, {"length": length_reward}, settings, tok.decode,
                             tok.pad_token_id, [tok.eos_token_id], seed=3, reference=reference)
    g = torch.Generator().manual_seed(0)  # an old policy far enough that ratios leave the clip range
    batch = dataclasses.replace(batch, old_logps=batch.old_logps + 0.3 * torch.randn(batch.old_logps.shape,
                                                                                         generator=g))
    return trainer, batch, settings


def _grad(model):
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None]).clone()


@pytest.mark.parametrize("loss_type", ["dapo", "dr_grpo", "grpo", "bnpo"])
@pytest.mark.parametrize("splits", [[8], [4, 4]])
def test_the_step_is_trls_on_the_same_generations(setup, loss_type, splits):
    trainer, batch, settings = setup
    settings = dataclasses.replace(settings, loss_type=loss_type)
    # as a TRL run with gradient_accumulation_steps = len(splits) (its steps_per_generation defaults to it)
    trainer.loss_type, trainer.current_gradient_accumulation_steps = loss_type, len(splits)
    trainer.args.steps_per_generation = len(splits)
    trainer._metrics["train"].clear()
    bounds = torch.tensor([0, *splits]).cumsum(0).tolist()
    rows = [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]
    model, g = trainer.model, batch.gens
    model.train()
    model.zero_grad()
    theirs = 0.0
    for r in rows:
        loss = trainer._compute_loss(model, {
            "prompt_ids": g.prompt_ids[r], "prompt_mask": g.prompt_mask[r], "completion_ids": g.completion_ids[r],
            "completion_mask": g.completion_mask[r], "advantages": batch.advantages[r],
            "old_per_token_logps": batch.old_logps[r], "ref_per_token_logps": batch.ref_logps[r],
            "num_items_in_batch": g.completion_mask.sum()})
        loss.backward()
        theirs += float(loss.detach())
    their_grad = _grad(model)
    model.zero_grad()
    ours, figures, counts = 0.0, grpo_batch.Figures(), grpo_batch.counts(batch, rows)
    for r in rows:
        loss = grpo_batch.micro_batch_loss(model, batch, r, counts, settings, figures)
        loss.backward()
        ours += float(loss.detach())
    assert ours == pytest.approx(theirs, rel=TOL)
    assert float((_grad(model) - their_grad).norm() / their_grad.norm()) < TOL
    figs = figures.values(settings.beta)
    assert figs["clip_ratio/region_mean"] > 0
    for name in ("kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
        # TRL averages its per-micro-batch values; with micro-batches of equal tokens that is the step's
        values = trainer._metrics["train"][name]
        if len(splits) == 1 or g.completion_mask[rows[0]].sum() == g.completion_mask[rows[1]].sum():
            assert figs[name] == pytest.approx(sum(values) / len(values), rel=TOL, abs=1e-7), name
