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


def _packaged_step(model, ids, mask, prompt_len: int, splits: list[int], loss_type: str):
    """One GRPO step of the packaged model over fixed generations (``ids``: prompt + completion token ids,
    right-padded to one length; ``mask``: 1 at completion tokens) in micro-batches of ``splits``: the summed
    loss and each parameter's gradient (float64). Old-policy and reference log-probabilities are the model's
    own shifted by fixed amounts, so the clip and the KL are both active."""
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0], dtype=torch.float64)
    adv = grpo.advantages(rewards, 4)
    shift = torch.linspace(-0.4, 0.4, mask.numel(), dtype=torch.float64).view_as(mask)
    bounds = torch.tensor([0, *splits]).cumsum(0).tolist()
    parts = [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]
    counts = grpo.step_counts([mask[p] for p in parts])
    model.zero_grad(set_to_none=True)
    total = 0.0
    for p in parts:
        logits = model(input_ids=ids[p]).logits  # right padding: no real token attends to it
        logps = torch.log_softmax(logits[:, prompt_len - 1:-1], dim=-1).gather(
            -1, ids[p, prompt_len:].unsqueeze(-1)).squeeze(-1)
        old, ref = logps.detach() + shift[p], logps.detach() - shift[p]
        loss = grpo.micro_batch_loss(grpo.per_token_loss(logps, old, adv[p], 0.2, 0.28, 0.04, ref), mask[p],
                                     loss_type, counts, mask.shape[1])
        loss.backward()
        total += float(loss.detach())
    return total, [q.grad.detach().clone() for q in model.parameters()]


@pytest.mark.slow  # the packaged model: make test-all
@pytest.mark.big_memory
def test_on_the_packaged_chat_model_every_split_of_a_grpo_step_is_exact_in_float64():
    """The packaged SmolLM2-135M-Instruct itself in float64 (its norms and attention too), one prompt's four
    completions of 3 to 7 tokens: 4 x 1 = 2 x 2 = 1 + 3 for dapo, dr_grpo and grpo, the loss and every
    parameter's gradient within 1e-12 (relative to the largest, at least 1)."""
    from tests.unit.equivalence import float64 as f64
    tokenizer = f64.chat_tokenizer()
    prompt = tokenizer("What is 7 + 5?")["input_ids"]
    completions = [tokenizer(t)["input_ids"] for t in (" 12", " The answer is 12.", " 13", " I think it is twelve")]
    width = max(len(c) for c in completions)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([prompt + c + [pad] * (width - len(c)) for c in completions])
    mask = torch.tensor([[1.0] * len(c) + [0.0] * (width - len(c)) for c in completions], dtype=torch.float64)
    assert len({int(m.sum()) for m in mask}) >= 3  # uneven lengths: where grpo's and dapo's weights differ
    model = f64.packaged_chat_model("eager").double().eval()
    with f64.float64_throughout(model):
        for loss_type in ("dapo", "dr_grpo", "grpo"):
            one_loss, one_grads = _packaged_step(model, ids, mask, len(prompt), [4], loss_type)
            scale = max(1.0, max(float(g.abs().max()) for g in one_grads))
            for splits in ([2, 2], [1, 3]):
                loss, grads = _packaged_step(model, ids, mask, len(prompt), splits, loss_type)
                assert abs(loss - one_loss) < 1e-12, (loss_type, splits, loss, one_loss)
                worst = max(float((g - w).abs().max()) for g, w in zip(grads, one_grads))
                assert worst <= 1e-12 * scale, (loss_type, splits, worst, scale)
