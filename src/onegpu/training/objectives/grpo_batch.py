"""One GRPO optimizer step's generation batch: sampled, scored and given its advantages over whole groups
before any split, then trained on micro-batch by micro-batch with the step's own counts, and its figures
(TRL's names) taken over the whole step, not averaged per micro-batch.

The definitions are TRL 1.16's ``GRPOTrainer`` (``trl/trainer/grpo_trainer.py``): the rewards in
``_generate_and_score_completions`` (each function's scores weighted and summed with ``nansum``; a
completion that no function could score has a NaN reward, is left out of its group's mean and standard
deviation, and gets advantage 0), the figures in ``_compute_loss`` (``kl``, ``clip_ratio/*``: masked means
over the completion tokens). Where TRL takes a figure per micro-batch and averages the micro-batches'
values, here each is one ratio of sums over the step, so that it is the same for every split.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from onegpu.training.objectives import generation, grpo, rewards


@dataclass(frozen=True)
class Settings:
    """The step's GRPO settings (TRL's ``GRPOConfig`` names and defaults, ``num_generations`` aside)."""
    sampling: generation.Sampling = generation.Sampling()
    loss_type: str = "dapo"
    epsilon: float = 0.2
    epsilon_high: float | None = None
    beta: float = 0.0
    scale_rewards: str = "group"
    num_iterations: int = 1
    use_bias_correction_kl: bool = True  # the KL term times the importance ratio (TRL's default)
    reward_weights: tuple[float, ...] | None = None  # None: 1.0 each


@dataclass
class StepBatch:
    """One optimizer step's completions, scored, with what the loss needs of them.

    Attributes:
        gens: the :class:`~onegpu.training.objectives.generation.Generations`.
        per_func: ``(rows, functions)`` float64 scores, NaN where a function returned None.
        total: ``(rows,)`` float64, the weighted sum (NaN: unscorable).
        advantages: ``(rows,)`` in the policy's dtype, over whole groups.
        old_logps: ``(rows, completion_length)``, the generating policy's log-probabilities, taken once when
            ``num_iterations`` > 1 (None: each micro-batch's own, detached, so the ratio is 1).
        ref_logps: the reference's, when ``beta`` is not 0 (None otherwise).
        names: the reward functions' names, ``per_func``'s columns.
        texts: the completions as decoded text (the table of sampled completions).
    """
    gens: object
    per_func: object
    total: object
    advantages: object
    old_logps: object = None
    ref_logps: object = None
    names: tuple[str, ...] = ()
    texts: list[str] = field(default_factory=list)

    @property
    def rows(self) -> int:
        return int(self.gens.completion_ids.shape[0])


def _score(funcs: dict[str, Callable], prompts: list, texts: list[str], columns: dict[str, list],
           weights: tuple[float, ...] | None, num_generations: int):
    """``(per_func, total)`` float64 tensors: each function's scores of ``texts`` (a prompt and its columns
    repeated for each of its completions) and their weighted ``nansum`` (NaN where none scored)."""
    import torch
    def each(values):
        return [v for v in values for _ in range(num_generations)]
    scores = rewards.score(funcs, each(prompts), texts, {k: each(v) for k, v in columns.items()})
    per_func = torch.tensor([[float("nan") if s is None else s for s in col] for col in scores.values()],
                            dtype=torch.float64).T.reshape(len(texts), len(funcs))
    w = torch.tensor(weights if weights is not None else [1.0] * len(funcs), dtype=torch.float64)
    total = (per_func * w).nansum(dim=1)
    total[torch.isnan(per_func).all(dim=1)] = float("nan")
    return per_func, total


def build(model, prompts: list, prompt_ids: list[list[int]], columns: dict[str, list], funcs: dict[str, Callable],
          settings: Settings, decode: Callable[[list[int]], str], pad_token_id: int, eos_token_ids: list[int],
          seed: int, reference=None) -> StepBatch:
    """Sample, score and give advantages to one optimizer step's completions (the whole step, every
    micro-batch's, before any split).

    Args:
        model: the policy (a causal LM).
        prompts: the step's prompts as the reward functions take them (text or messages).
        prompt_ids: the same, tokenized.
        columns: the rows' other columns (e.g. ``answer``), one value per prompt.
        funcs: name -> reward function (:func:`onegpu.training.objectives.rewards.resolve`).
        settings: :class:`Settings`.
        decode: completion token ids (up to and including EOS) -> text.
        seed: this step's sampling seed.
        reference: the reference model (``beta`` not 0); None: none.
    Raises:
        ValueError: ``beta`` is not 0 and there is no reference.
    """
    import torch
    if settings.beta != 0.0 and reference is None:
        raise ValueError("beta is not 0: a reference model is needed")
    s = settings.sampling
    gens = generation.sample(model, prompt_ids, s, pad_token_id, eos_token_ids, seed)
    texts = [decode(ids[:n]) for ids, n in zip(gens.completion_ids.tolist(), gens.lengths.tolist())]
    per_func, total = _score(funcs, prompts, texts, columns, settings.reward_weights, s.num_generations)
    dtype = next(model.parameters()).dtype
    adv = grpo.advantages(total, s.num_generations, settings.scale_rewards)
    old = ref = None
    with torch.no_grad():
        if settings.num_iterations > 1:
            old = generation.token_logps(model, gens, s.temperature)
        if reference is not None and settings.beta != 0.0:
            ref = generation.token_logps(reference, gens, s.temperature)
    device = gens.completion_ids.device
    return StepBatch(gens, per_func, total, adv.to(device=device, dtype=dtype if dtype.is_floating_point else None),
                     old, ref, tuple(funcs), texts)


def counts(batch: StepBatch, splits: list) -> grpo.StepCounts:
    """The step's :class:`~onegpu.training.objectives.grpo.StepCounts` for micro-batches ``splits`` of ``batch`` (each
    a slice or an index tensor of its rows); one host read."""
    import torch
    masks = [batch.gens.completion_mask[r] for r in splits]
    tokens = int(torch.stack([m.sum() for m in masks]).sum())
    return grpo.StepCounts(sum(int(m.shape[0]) for m in masks), tokens, len(masks))


@dataclass
class Figures:
    """The step's sums for TRL's per-step figures: :meth:`add` per micro-batch keeps them on the device (no host
    sync in the step's loop), :meth:`values` reads them once at the step's end."""
    sums: list = field(default_factory=list)  # per micro-batch: (tokens, kl, low-clipped, high-clipped) tensors
    low_seq: list = field(default_factory=list)  # per micro-batch: each sequence's low-clipped share
    high_seq: list = field(default_factory=list)

    def add(self, ratio, advantage, mask, epsilon: float, epsilon_high: float, kl=None) -> None:
        """One micro-batch: ``ratio`` and ``mask`` ``(rows, length)``, ``advantage`` ``(rows,)``, ``kl`` per token."""
        import torch
        m = mask.to(ratio.dtype)
        a = advantage.unsqueeze(1)
        low = ((ratio < 1 - epsilon) & (a < 0)).to(ratio.dtype) * m
        high = ((ratio > 1 + epsilon_high) & (a > 0)).to(ratio.dtype) * m
        per_seq = m.sum(-1).clamp(min=1.0)
        self.sums.append(torch.stack([m.sum(), (kl * m).sum() if kl is not None else m.new_zeros(()),
                                      low.sum(), high.sum()]))
        self.low_seq.append(low.sum(-1) / per_seq)
        self.high_seq.append(high.sum(-1) / per_seq)

    def values(self, beta: float) -> dict[str, float]:
        """``kl`` (when ``beta`` is not 0) and ``clip_ratio/*`` over the whole step's completion tokens (one
        host read)."""
        import torch
        if not self.sums:
            return {}
        sums = torch.stack(self.sums).double().sum(0)
        seq = torch.stack([torch.cat(self.low_seq).min(), torch.cat(self.high_seq).max()]).double()
        (tokens, kl, low, high), (low_min, high_max) = sums.tolist(), seq.tolist()
        n = max(tokens, 1.0)
        out = {"clip_ratio/low_mean": low / n, "clip_ratio/high_mean": high / n,
               "clip_ratio/region_mean": (low + high) / n, "clip_ratio/low_min": low_min,
               "clip_ratio/high_max": high_max}
        if beta != 0.0:
            out["kl"] = kl / n
        return out


def micro_batch_loss(model, batch: StepBatch, rows, step: grpo.StepCounts, settings: Settings,
                     figures: Figures | None = None):
    """Micro-batch ``rows`` of ``batch`` (a slice or an index tensor): its share of the step's loss (a 0-dim tensor
    with grad, summed over the step's micro-batches: the step's loss, :func:`onegpu.training.objectives.grpo.
    micro_batch_loss`), its figures added to ``figures``."""
    import torch
    s = settings.sampling
    logps = generation.token_logps(model, batch.gens, s.temperature, rows)
    old = batch.old_logps[rows] if batch.old_logps is not None else logps.detach()
    ref = batch.ref_logps[rows] if batch.ref_logps is not None else None
    adv = batch.advantages[rows].to(logps.dtype)
    mask = batch.gens.completion_mask[rows]
    token_loss = grpo.per_token_loss(logps, old, adv, settings.epsilon, settings.epsilon_high, settings.beta, ref,
                                     settings.use_bias_correction_kl)
    if figures is not None:
        with torch.no_grad():
            ratio = torch.exp(logps - old)
            kl = None
            if ref is not None:  # TRL's logged kl: the per-token term as the loss has it (times the ratio)
                kl = torch.exp(ref - logps) - (ref - logps) - 1
                kl = kl * ratio if settings.use_bias_correction_kl else kl
            high = settings.epsilon if settings.epsilon_high is None else settings.epsilon_high
            figures.add(ratio, adv, mask, settings.epsilon, high, kl)
    return grpo.micro_batch_loss(token_loss, mask, settings.loss_type, step, s.max_completion_length)


def step_figures(batch: StepBatch, num_generations: int) -> dict[str, float]:
    """TRL's per-step figures of the generations (``rewards/<name>/mean`` and ``/std``, ``reward``,
    ``reward_std``, ``frac_reward_zero_std``: the share of groups whose rewards are all equal, and
    ``completions/*`` in tokens), over the whole step."""
    import torch
    out = {}
    for i, name in enumerate(batch.names):
        out[f"rewards/{name}/mean"] = float(torch.nanmean(batch.per_func[:, i]))
        out[f"rewards/{name}/std"] = float(grpo.nanstd(batch.per_func[:, i]))
    out["reward"] = float(torch.nanmean(batch.total))
    out["reward_std"] = float(grpo.nanstd(batch.total))
    group_std = grpo.nanstd(batch.total.view(-1, num_generations), dim=1)
    out["frac_reward_zero_std"] = float(torch.isclose(group_std, torch.zeros_like(group_std)).double().mean())
    lengths = batch.gens.lengths.double()  # (on the device: one host read for the four)
    mean, low, high, clipped = torch.stack([lengths.mean(), lengths.min(), lengths.max(),
                                            batch.gens.truncated.double().mean()]).tolist()
    out.update({"completions/mean_length": mean, "completions/min_length": low, "completions/max_length": high,
                "completions/clipped_ratio": clipped})
    return out
