"""onegpu.training.objectives.grpo: advantages over whole groups as TRL computes them, and the step's loss
and gradient the same for every split of its micro-batches in float64 under dapo, dr_grpo and grpo
(bnpo's difference measured)."""
from __future__ import annotations

import pytest
import torch

from onegpu.training.objectives import grpo

MAX_LEN = 6  # max_completion_length of the fixed generations


def _generations(n: int = 8, seed: int = 0):
    """Fixed generations: ``n`` completions (2 prompts x 4, or 7 of them) of lengths 1 to 6 (token ids
    ``(n, MAX_LEN)`` int64, mask ``(n, MAX_LEN)`` float64) and rewards (float64, two groups of 4)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 11, (8, MAX_LEN), generator=g)
    lengths = torch.tensor([6, 1, 4, 2, 5, 3, 6, 2])
    mask = (torch.arange(MAX_LEN) < lengths.unsqueeze(1)).double()
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0, 1.0, 1.0, 0.0, 0.25], dtype=torch.float64)
    return tokens[:n], mask[:n], rewards


class _Policy(torch.nn.Module):
    """A tiny float64 policy: each completion token's log-probability from the previous token's embedding."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = torch.nn.Embedding(11, 5, dtype=torch.float64)
        self.out = torch.nn.Linear(5, 11, dtype=torch.float64)

    def forward(self, tokens):
        prev = torch.cat([torch.zeros_like(tokens[:, :1]), tokens[:, :-1]], dim=1)
        logp = torch.log_softmax(self.out(self.emb(prev)), dim=-1)
        return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def _step(splits: list[int], loss_type: str, n: int = 8, beta: float = 0.04):
    """One optimizer step over the fixed generations split into micro-batches of ``splits`` completions:
    the summed loss and the gradient (every parameter flattened), float64. The old policy (another seed)
    makes the ratios move past the clip range; the reference (a third) makes the KL non-zero."""
    tokens, mask, rewards = _generations(n)
    adv = grpo.advantages(rewards, 4)[:n]  # the whole groups' advantages, before any split
    policy, old, ref = _Policy(0), _Policy(1), _Policy(2)
    with torch.no_grad():
        old_logps, ref_logps = old(tokens), ref(tokens)
    bounds = torch.tensor([0, *splits]).cumsum(0).tolist()
    parts = [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]
    counts = grpo.step_counts([mask[p] for p in parts])
    total = 0.0
    for p in parts:
        token_loss = grpo.per_token_loss(policy(tokens[p]), old_logps[p], adv[p], 0.2, 0.28, beta, ref_logps[p])
        loss = grpo.micro_batch_loss(token_loss, mask[p], loss_type, counts, MAX_LEN)
        loss.backward()
        total += float(loss.detach())
    return total, torch.cat([q.grad.reshape(-1) for q in policy.parameters()])


def _trl_nanstd(x, dim=None):
    """TRL 1.16's ``nanstd`` (trl/trainer/utils.py) on values without NaN: the mean of the squared deviations
    times n / (n - 1), square-rooted."""
    n = x.shape[dim] if dim is not None else x.numel()
    mean = x.mean(dim=dim, keepdim=True) if dim is not None else x.mean()
    return (((x - mean) ** 2).mean(dim=dim) * n / (n - 1)).sqrt()


def test_advantages_are_trls_over_each_whole_group():
    """TRL 1.16: (reward - the group's mean) / (the group's Bessel-corrected std + 1e-4); a group of equal
    rewards gets 0; ``batch`` scales by the whole batch's std, ``none`` not at all. Within 1e-14: the two
    compute the std in another order (a few float64 ulps of values near 1)."""
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0, 1.0, 1.0, 1.0, 1.0], dtype=torch.float64)
    groups = rewards.view(-1, 4)
    centred = rewards - groups.mean(1).repeat_interleave(4)
    want = centred / (_trl_nanstd(groups, dim=1).repeat_interleave(4) + 1e-4)
    assert (grpo.advantages(rewards, 4) - want).abs().max() < 1e-14
    assert grpo.advantages(rewards, 4)[4:].abs().max() == 0.0  # all four right: no signal
    assert (grpo.advantages(rewards, 4, "batch") - centred / (_trl_nanstd(rewards) + 1e-4)).abs().max() < 1e-14
    assert torch.equal(grpo.advantages(rewards, 4, "none"), centred)


def test_a_group_split_across_micro_batches_keeps_its_advantages():
    """The planted split: a group's completions in two micro-batches. Advantages taken per micro-batch (the
    bug) see half a group and differ; taken once over the whole group, each completion's is what it is in
    one batch."""
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0], dtype=torch.float64)
    whole = grpo.advantages(rewards, 4)
    halves = torch.cat([grpo.advantages(rewards[:2], 2), grpo.advantages(rewards[2:], 2)])
    assert (whole - halves).abs().max() > 0.1
    assert torch.equal(grpo.advantages(rewards, 4)[2:], whole[2:])


@pytest.mark.parametrize("loss_type", ["dapo", "dr_grpo", "grpo"])
def test_every_split_of_the_step_is_one_batch_in_float64(loss_type):
    """8 x 1 = 2 x 4 = 1 x 8 (and 7 completions as 4 + 3 = 7 x 1): the same loss and gradient within 1e-12,
    with clipping and the KL active."""
    one_loss, one_grad = _step([8], loss_type)
    for splits in ([1] * 8, [4, 4], [2, 2, 2, 2], [3, 5]):
        loss, grad = _step(splits, loss_type)
        assert abs(loss - one_loss) < 1e-12, (splits, loss, one_loss)
        assert (grad - one_grad).abs().max() < 1e-12, splits
    seven_loss, seven_grad = _step([7], loss_type, n=7)
    loss, grad = _step([4, 3], loss_type, n=7)
    assert abs(loss - seven_loss) < 1e-12 and (grad - seven_grad).abs().max() < 1e-12


def test_bnpo_moves_with_the_split_and_by_how_much():
    """bnpo (TRL's: each micro-batch's token mean / the accumulation steps) is split-dependent by definition:
    on these lengths 4 + 3 differs from 7 as one batch by more than float64 rounding, and an even split of
    equal token counts would not."""
    seven, _ = _step([7], "bnpo", n=7)
    split, _ = _step([4, 3], "bnpo", n=7)
    assert abs(split - seven) > 1e-4, (split, seven)


def test_bad_arguments_are_one_clear_error():
    with pytest.raises(ValueError, match="whole groups"):
        grpo.advantages(torch.zeros(6, dtype=torch.float64), 4)
    with pytest.raises(ValueError, match="scale_rewards"):
        grpo.advantages(torch.zeros(8, dtype=torch.float64), 4, "per-token")
    with pytest.raises(ValueError, match="loss_type"):
        grpo.micro_batch_loss(torch.zeros(1, 2), torch.ones(1, 2), "mean", grpo.StepCounts(1, 2, 1), 2)
    with pytest.raises(ValueError, match="reference"):
        grpo.per_token_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1), beta=0.1)
