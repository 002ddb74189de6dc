"""onegpu.training.objectives.grpo_batch on a tiny float64 Llama with real sampled completions: one step's
loss, gradient and figures the same for every split of its generation batch (8 x 1 = 2 x 4 = 1 x 8 = an
uneven 5 + 3 that cuts a group) under dapo, dr_grpo and grpo within 1e-12, bnpo's movement measured,
advantages over whole groups (a planted split), unscorable completions as TRL treats them, and
num_iterations' old log-probabilities taken once."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from onegpu.training.objectives import generation, grpo, grpo_batch
from tests.unit.equivalence.float64 import float64_throughout

PAD, EOS = 0, list(range(1, 41))
PROMPTS = [[50, 51, 52, 53], [60, 61]]
SPLITS = {"8 x 1": [8], "2 x 4": [4, 4], "1 x 8": [1] * 8, "5 + 3": [5, 3]}
REL = 1e-12


def _tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=True, pad_token_id=PAD)
    return LlamaForCausalLM(cfg).double()


def _decode(ids):
    return " ".join(map(str, ids))


def length_reward(prompts, completions, **columns):
    """A completion's words modulo 3, halved: rewards that differ within a group."""
    return [(len(c.split()) % 3) / 2 for c in completions]


def odd_reward(prompts, completions, answer, **columns):
    """1 where the completion's first token id is odd, None (unscorable) where it is a multiple of 5."""
    out = []
    for c, a in zip(completions, answer):
        first = int(c.split()[0])
        out.append(None if first % 5 == 0 else float(first % 2) * a)
    return out


FUNCS = {"length": length_reward, "odd": odd_reward}
COLUMNS = {"answer": [1.0, 2.0]}


def _settings(loss_type="dapo", beta=0.04, **kw):
    sampling = generation.Sampling(num_generations=4, max_completion_length=6, temperature=0.9)
    return grpo_batch.Settings(sampling=sampling, loss_type=loss_type, beta=beta, epsilon_high=0.28, **kw)


@pytest.fixture(scope="module")
def fixed():
    """The policy, a reference, and one step's generation batch with an old policy's log-probabilities
    moved enough that ratios leave the clip range (as after an earlier iteration)."""
    policy, reference = _tiny_llama(0), _tiny_llama(1)
    with float64_throughout(policy), float64_throughout(reference):
        batch = grpo_batch.build(policy, ["p0", "p1"], PROMPTS, COLUMNS, FUNCS, _settings(num_iterations=2), _decode,
                                 PAD, EOS, seed=11, reference=reference)
    g = torch.Generator().manual_seed(0)
    moved = batch.old_logps + 0.3 * torch.randn(batch.old_logps.shape, generator=g, dtype=torch.float64)
    return policy, dataclasses.replace(batch, old_logps=moved)


def _step(policy, batch, splits, loss_type):
    bounds = torch.tensor([0, *splits]).cumsum(0).tolist()
    rows = [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]
    settings, counts, figures = _settings(loss_type), grpo_batch.counts(batch, rows), grpo_batch.Figures()
    policy.zero_grad()
    total = 0.0
    with float64_throughout(policy):
        for r in rows:
            loss = grpo_batch.micro_batch_loss(policy, batch, r, counts, settings, figures)
            loss.backward()
            total += float(loss.detach())
    grad = torch.cat([p.grad.reshape(-1) for p in policy.parameters() if p.grad is not None])
    return total, grad.clone(), figures.values(settings.beta)


@pytest.mark.parametrize("loss_type", ["dapo", "dr_grpo", "grpo"])
def test_every_split_gives_the_same_step(fixed, loss_type):
    policy, batch = fixed
    assert batch.gens.lengths.unique().numel() > 1  # completions of different lengths: the split matters
    whole_loss, whole_grad, whole_figs = _step(policy, batch, SPLITS["8 x 1"], loss_type)
    assert whole_figs["clip_ratio/region_mean"] > 0 and whole_figs["kl"] > 0  # clipping and KL both act
    for name, splits in SPLITS.items():
        loss, grad, figs = _step(policy, batch, splits, loss_type)
        assert loss == pytest.approx(whole_loss, rel=REL, abs=1e-15), name
        assert float((grad - whole_grad).norm() / whole_grad.norm()) < REL, name
        assert figs == pytest.approx(whole_figs, rel=REL, abs=1e-15), name


def test_bnpo_moves_with_the_split_by_a_measured_amount(fixed):
    """bnpo is TRL's per-micro-batch token mean: the same at 8 x 1 as dapo, different once split unevenly."""
    policy, batch = fixed
    dapo, _, _ = _step(policy, batch, [8], "dapo")
    whole, _, _ = _step(policy, batch, [8], "bnpo")
    uneven, _, _ = _step(policy, batch, [5, 3], "bnpo")
    assert whole == pytest.approx(dapo, rel=REL)
    moved = abs(uneven - whole) / abs(whole)
    assert moved > 1e-3, f"bnpo moved by {moved:.2e} relative at 5 + 3"


def test_a_group_split_across_micro_batches_keeps_its_whole_groups_advantages(fixed):
    """Rows 5..7 (the second group's last three) alone would centre on their own mean: the batch's
    advantages are the whole group's whatever the micro-batch holds."""
    _, batch = fixed
    whole = grpo.advantages(batch.total, 4, "group")
    assert torch.equal(batch.advantages, whole)
    part = batch.total[5:8]
    local = (part - torch.nanmean(part)) / (grpo.nanstd(part) + grpo.STD_EPS)
    assert not torch.allclose(local, whole[5:8])  # what a split-first computation would have given


def test_unscorable_completions_are_left_out_of_their_group_and_get_no_advantage():
    from trl.trainer.utils import nanstd as trl_nanstd
    total = torch.tensor([1.0, float("nan"), 0.0, 0.5, 1.0, 1.0, 0.0, float("nan")], dtype=torch.float64)
    adv = grpo.advantages(total, 4, "group")
    assert adv[1] == 0 and adv[7] == 0
    g = total.view(2, 4)
    want = (g - torch.nanmean(g, dim=1, keepdim=True)) / (trl_nanstd(g, dim=1).unsqueeze(1) + 1e-4)
    assert torch.allclose(adv, torch.nan_to_num(want, nan=0.0).reshape(-1), rtol=0, atol=1e-15)
    # TRL's Bessel factor count / (count - 1) is an integer tensor's true division: float32, 1.2000000477 for
    # 6 values; here 1.2 in float64. The groups above agree to 1e-15 as each has 3 values (3 / 2 is exact).
    assert float(grpo.nanstd(total)) == pytest.approx(float(trl_nanstd(total)), rel=1e-7)
    assert float(grpo.nanstd(total)) == pytest.approx(float(total[~total.isnan()].std()), rel=1e-15)


def test_the_scores_and_step_figures_follow_trls_definitions(fixed):
    _, batch = fixed
    assert batch.names == ("length", "odd") and len(batch.texts) == 8
    firsts = [int(t.split()[0]) for t in batch.texts]
    want_odd = [float("nan") if f % 5 == 0 else (f % 2) * (1.0 if i < 4 else 2.0) for i, f in enumerate(firsts)]
    assert torch.allclose(batch.per_func[:, 1], torch.tensor(want_odd, dtype=torch.float64), equal_nan=True)
    figs = grpo_batch.step_figures(batch, 4)
    lengths = batch.gens.lengths.double()
    assert figs["completions/mean_length"] == pytest.approx(float(lengths.mean()))
    assert figs["completions/clipped_ratio"] == pytest.approx(float(batch.gens.truncated.double().mean()))
    assert figs["reward"] == pytest.approx(float(torch.nanmean(batch.total)))
    assert set(figs) >= {"rewards/length/mean", "rewards/odd/std", "reward_std", "frac_reward_zero_std"}


def test_num_iterations_takes_the_old_policys_log_probs_once():
    """num_iterations 2: old_logps are the generating policy's, taken at build; after an update the second
    iteration's ratios move from 1 while old_logps stay as taken. At 1: none kept, the ratio is exactly 1."""
    policy = _tiny_llama(0)
    settings = _settings(beta=0.0, num_iterations=2)
    with float64_throughout(policy):
        batch = grpo_batch.build(policy, ["p0", "p1"], PROMPTS, COLUMNS, FUNCS, settings, _decode, PAD, EOS, seed=5)
        kept = batch.old_logps.clone()
        with torch.no_grad():
            now = generation.token_logps(policy, batch.gens, 0.9)
        m = batch.gens.completion_mask.bool()
        assert torch.allclose(now[m], kept[m], rtol=0, atol=1e-12)
        rows = [slice(0, 8)]
        loss = grpo_batch.micro_batch_loss(policy, batch, rows[0], grpo_batch.counts(batch, rows), settings)
        loss.backward()
        with torch.no_grad():
            for p in policy.parameters():
                p -= 0.5 * p.grad
            moved = generation.token_logps(policy, batch.gens, 0.9)
        assert torch.equal(batch.old_logps, kept) and float((moved - kept)[m].abs().max()) > 1e-4
        once = grpo_batch.build(policy, ["p0", "p1"], PROMPTS, COLUMNS, FUNCS, _settings(beta=0.0), _decode, PAD,
                                EOS, seed=5)
    assert once.old_logps is None and once.ref_logps is None


def test_in_float32_every_split_is_the_same_step_within_1e_6(fixed):
    """The same step in float32 (the model and the batch's log-probabilities cast): the splits agree to
    float32's rounding, 1e-6 relative in the loss and the gradient."""
    policy, batch = fixed
    p32 = _tiny_llama(0).float()
    p32.load_state_dict(policy.state_dict())
    b32 = dataclasses.replace(batch, advantages=batch.advantages.float(), old_logps=batch.old_logps.float(),
                              ref_logps=batch.ref_logps.float())
    for loss_type in ("dapo", "dr_grpo", "grpo"):
        whole_loss, whole_grad, _ = _step(p32, b32, [8], loss_type)
        assert whole_grad.dtype == torch.float32
        for name, splits in SPLITS.items():
            loss, grad, _ = _step(p32, b32, splits, loss_type)
            assert loss == pytest.approx(whole_loss, rel=1e-6), (loss_type, name)
            assert float((grad - whole_grad).norm() / whole_grad.norm()) < 1e-6, (loss_type, name)


@pytest.mark.slow  # the packaged model: make test-all
@pytest.mark.big_memory
def test_on_the_packaged_chat_model_its_own_sampled_completions_give_the_same_step_for_every_split():
    """The packaged SmolLM2-135M-Instruct in float64 samples two chat prompts' four completions each (up to 8
    tokens, seeded); 8 x 1 = 2 x 4 = 5 + 3 for dapo and grpo (dr_grpo is dapo's sum over another constant),
    loss and gradient within 1e-12. The old policy's and the reference's log-probabilities are the model's
    own shifted by fixed amounts, so the clip and the KL both act."""
    from tests.unit.equivalence import float64 as f64
    tok = f64.chat_tokenizer()
    prompts = ["What is 7 + 5? Answer with a number.", "Name the capital of France."]
    ids = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True,
                                   return_dict=False) for p in prompts]
    model = f64.packaged_chat_model("eager").double()
    settings = grpo_batch.Settings(sampling=generation.Sampling(4, 8, 1.0), num_iterations=2)
    with f64.float64_throughout(model):
        batch = grpo_batch.build(model, prompts, ids, {}, {"length": length_reward}, settings, tok.decode,
                                 tok.pad_token_id, [tok.eos_token_id], seed=1)
    shift = torch.linspace(-0.4, 0.4, batch.old_logps.numel(), dtype=torch.float64).view_as(batch.old_logps)
    batch = dataclasses.replace(batch, old_logps=batch.old_logps + shift, ref_logps=batch.old_logps - shift)
    for loss_type in ("dapo", "grpo"):
        whole_loss, whole_grad, figs = _step(model, batch, [8], loss_type)
        assert figs["clip_ratio/region_mean"] > 0 and figs["kl"] > 0
        for name in ("2 x 4", "5 + 3"):
            loss, grad, _ = _step(model, batch, SPLITS[name], loss_type)
            assert loss == pytest.approx(whole_loss, rel=REL, abs=1e-15), (loss_type, name)
            assert float((grad - whole_grad).norm() / whole_grad.norm()) < REL, (loss_type, name)
