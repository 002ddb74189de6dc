"""GRPO's optimizer step, exact under gradient accumulation: the first piece of the GRPO objective (its
reader, rewards, generation and registration come with it).

The definitions are TRL 1.16's ``GRPOTrainer`` (``trl/trainer/grpo_trainer.py``: the advantages in
``_generate_and_score_completions``, the loss in ``_compute_loss``; ``trl/trainer/utils.py``'s ``nanstd``).
What differs is where the normalisation is taken: TRL divides each micro-batch by its own counts and by
the accumulation steps, so ``grpo``'s mean of sequence means and ``bnpo``'s token mean depend on how the
step is split. Here each micro-batch's sum is divided by the whole optimizer step's counts
(:class:`StepCounts`, as :mod:`onegpu.training.objectives.loss` does for SFT), so for ``dapo``, ``dr_grpo``
and ``grpo`` the micro-batches' losses add up to the one-big-batch loss whatever the split; ``bnpo`` keeps
TRL's definition (the mean over micro-batches of their token means: split-dependent by definition, which
TRL's docs say), so its difference from one big batch can be measured.

Advantages are computed over the whole group of a prompt's completions before any split into
micro-batches or processes (:func:`advantages`): a split can never see part of a group.
"""
from __future__ import annotations

from dataclasses import dataclass

LOSS_TYPES = ("dapo", "dr_grpo", "grpo", "bnpo")  # TRL's names; dapo is its default
SCALE_REWARDS = ("group", "batch", "none")  # TRL's scale_rewards
STD_EPS = 1e-4  # TRL's: advantages / (std + 1e-4), so a group of equal rewards has advantage 0


def nanstd(x, dim=None):
    """TRL's ``nanstd``: the Bessel-corrected standard deviation over the values that are not NaN (NaN for one
    value). TRL computes the factor ``count / (count - 1)`` as an integer tensor's division, in float32; here
    it is in ``x``'s dtype (a relative 4e-8 apart for 6 values in float64)."""
    import torch
    mean = torch.nanmean(x, dim=dim, keepdim=dim is not None)
    n = (~torch.isnan(x)).sum(dim=dim) if dim is not None else (~torch.isnan(x)).sum()
    return torch.sqrt(torch.nanmean((x - mean) ** 2, dim=dim) * n / (n - 1))


def advantages(rewards, num_generations: int, scale_rewards: str = "group"):
    """Group-relative advantages: each completion's reward minus its group's mean, divided by the group's
    standard deviation + 1e-4 (``scale_rewards`` ``group``), the whole batch's (``batch``) or not at all
    (``none``). A NaN reward (no reward function could score the completion) is left out of its group's mean
    and deviation (TRL's ``nanmean``, :func:`nanstd`) and gets advantage 0.

    Args:
        rewards: ``(prompts * num_generations,)`` float tensor, a prompt's completions contiguous (TRL's order).
        num_generations: completions per prompt (the group size), at least 2.
        scale_rewards: one of :data:`SCALE_REWARDS`.
    Returns:
        ``(prompts * num_generations,)`` advantages, ``rewards``' dtype and device.
    Raises:
        ValueError: ``num_generations`` below 2, ``rewards`` not a whole number of groups, or an unknown
            ``scale_rewards``.
    """
    import torch
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {', '.join(SCALE_REWARDS)}, got {scale_rewards!r}")
    if num_generations < 2 or rewards.numel() % num_generations:
        raise ValueError(f"{rewards.numel()} rewards are not whole groups of num_generations={num_generations} "
                         "(at least 2)")
    groups = rewards.view(-1, num_generations)
    centred = (groups - torch.nanmean(groups, dim=1, keepdim=True)).reshape(-1)
    if scale_rewards == "group":
        centred = centred / (nanstd(groups, dim=1).repeat_interleave(num_generations) + STD_EPS)
    elif scale_rewards == "batch":
        centred = centred / (nanstd(rewards) + STD_EPS)
    return torch.nan_to_num(centred, nan=0.0)


def per_token_loss(logps, old_logps, advantage, epsilon: float = 0.2, epsilon_high: float | None = None,
                   beta: float = 0.0, ref_logps=None, use_bias_correction_kl: bool = True):
    """The clipped surrogate per completion token, plus ``beta`` x the KL to a reference (TRL's token-level
    importance sampling):

        ratio = exp(logps - old_logps);  loss = -min(ratio x A, clip(ratio, 1 - epsilon, 1 + epsilon_high) x A)
        KL    = exp(ref - logps) - (ref - logps) - 1   (Schulman's k3 estimator, per token),
                x ratio under ``use_bias_correction_kl`` (TRL's default: the unbiased reverse-KL gradient,
                DeepSeek-V3.2; the ratio carries gradient even where it is 1)

    Args:
        logps: ``(sequences, completion_length)`` float log-probabilities of the completion tokens under the
            policy being trained (with grad).
        old_logps: the same under the policy that generated them (``num_iterations`` 1: ``logps.detach()``).
        advantage: ``(sequences,)`` float, :func:`advantages` of each sequence.
        epsilon, epsilon_high: the clip range (``epsilon_high`` None: ``epsilon``, TRL's default).
        beta: the KL coefficient (0: no reference, TRL's default).
        ref_logps: the reference model's log-probabilities, ``logps``' shape; needed when ``beta`` is not 0.
        use_bias_correction_kl: multiply the KL by the ratio (TRL's ``use_bias_correction_kl``, default True).
    Returns:
        ``(sequences, completion_length)`` per-token losses (padding positions included: the mask is applied
        by :func:`micro_batch_loss`).
    Raises:
        ValueError: ``beta`` is not 0 and ``ref_logps`` is None.
    """
    import torch
    high = epsilon if epsilon_high is None else epsilon_high
    ratio = torch.exp(logps - old_logps)
    a = advantage.unsqueeze(1)
    loss = -torch.min(ratio * a, torch.clamp(ratio, 1 - epsilon, 1 + high) * a)
    if beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta is not 0: the reference model's log-probabilities are needed")
        delta = ref_logps - logps
        kl = torch.exp(delta) - delta - 1
        loss = loss + beta * (kl * ratio if use_bias_correction_kl else kl)
    return loss


@dataclass(frozen=True)
class StepCounts:
    """What one optimizer step holds, over all its micro-batches (and, with several processes, summed over
    the ranks by the caller): completions, completion tokens (the mask's ones) and micro-batches."""
    sequences: int
    tokens: int
    micro_batches: int


def step_counts(masks) -> StepCounts:
    """The :class:`StepCounts` of the micro-batches' completion masks (each ``(sequences, length)``, 1 at a
    completion token, 0 at padding)."""
    return StepCounts(sum(int(m.shape[0]) for m in masks), sum(int(m.sum()) for m in masks), len(masks))


def micro_batch_loss(token_loss, mask, loss_type: str, counts: StepCounts, max_completion_length: int):
    """One micro-batch's share of the optimizer step's loss under ``loss_type`` (TRL's definitions):

    - ``dapo``: every completion token of the step weighs the same: sum / ``counts.tokens``;
    - ``dr_grpo``: sum / (``counts.sequences`` x ``max_completion_length``), no length normalisation;
    - ``grpo``: each sequence's token mean, averaged over the step's sequences (a short completion's
      tokens weigh more: the length bias Dr. GRPO names);
    - ``bnpo``: this micro-batch's token mean / ``counts.micro_batches`` (TRL's; split-dependent).

    Summed over the step's micro-batches, ``dapo``, ``dr_grpo`` and ``grpo`` give the loss of the step as
    one batch, for any split.

    Args:
        token_loss: ``(sequences, length)`` float, :func:`per_token_loss`.
        mask: ``(sequences, length)``, 1 at completion tokens.
        loss_type: one of :data:`LOSS_TYPES`.
        counts: the whole step's :class:`StepCounts`.
        max_completion_length: the generation limit (``dr_grpo``'s constant).
    Returns:
        A 0-dim tensor.
    Raises:
        ValueError: an unknown ``loss_type``.
    """
    mask = mask.to(token_loss.dtype)
    masked = token_loss * mask
    if loss_type == "dapo":
        return masked.sum() / max(counts.tokens, 1)
    if loss_type == "dr_grpo":
        return masked.sum() / (counts.sequences * max_completion_length)
    if loss_type == "grpo":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum() / counts.sequences
    if loss_type == "bnpo":
        return masked.sum() / mask.sum().clamp(min=1.0) / counts.micro_batches
    raise ValueError(f"loss_type must be one of {', '.join(LOSS_TYPES)}, got {loss_type!r}")
