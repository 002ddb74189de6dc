"""GRPO's generations: each optimizer step samples ``num_generations`` completions per prompt from the policy,
seeded per step, and scores their tokens' log-probabilities as the loss needs them.

The definitions are TRL 1.16's ``GRPOTrainer`` (``trl/trainer/grpo_trainer.py``): prompts left-padded, each
repeated ``num_generations`` times with a prompt's completions contiguous (its ``RepeatSampler``); the
completion mask keeps the tokens up to and including the first EOS (``_generate_single_turn``); a completion
with no EOS within ``max_completion_length`` is truncated; the log-probabilities are those of the logits
divided by the sampling temperature (``_get_per_token_logps_and_entropies``), so that at ``num_iterations``
1 the importance ratio is exactly 1.

Sampling draws from its own generator state (:func:`sample`'s ``seed``, under ``torch.random.fork_rng``): a
step's completions depend on the policy and ``(seed, step)`` only, not on what ran before (dropout, another
step's sampling), so a resumed run samples the same completions as an uninterrupted one.
"""
from __future__ import annotations

from dataclasses import dataclass

from onegpu.training.objectives import lm_head


@dataclass(frozen=True)
class Generations:
    """One step's completions, ``prompts * num_generations`` rows, a prompt's completions contiguous.

    Attributes:
        prompt_ids: ``(rows, prompt_length)`` int64, left-padded with the pad id.
        prompt_mask: ``(rows, prompt_length)`` int64, 1 at prompt tokens.
        completion_ids: ``(rows, completion_length)`` int64, right-padded with the pad id after the first EOS;
            ``completion_length`` <= ``max_completion_length``.
        completion_mask: ``(rows, completion_length)`` int64, 1 up to and including the first EOS.
        truncated: ``(rows,)`` bool, no EOS within ``max_completion_length`` (TRL's ``completions/clipped_ratio``).
    """
    prompt_ids: object
    prompt_mask: object
    completion_ids: object
    completion_mask: object
    truncated: object

    @property
    def lengths(self):
        """``(rows,)`` int64: each completion's tokens (its EOS included)."""
        return self.completion_mask.sum(dim=1)


def eos_ids(tokenizer, model) -> list[int]:
    """The ids that end a completion: the tokenizer's EOS and the model's generation config's (one or a list)."""
    found = [tokenizer.eos_token_id]
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    found += configured if isinstance(configured, list) else [configured]
    return list(dict.fromkeys(i for i in found if i is not None))


def left_padded(prompts: list[list[int]], pad_token_id: int, num_generations: int = 1):
    """``(ids, mask)``: the token-id lists as ``(len(prompts) * num_generations, longest)`` int64 tensors,
    each prompt repeated ``num_generations`` times in a row, left-padded with ``pad_token_id`` (mask 0 there).

    Raises:
        ValueError: no prompts, an empty prompt, or ``num_generations`` below 1.
    """
    import torch
    from torch.nn.utils.rnn import pad_sequence
    if not prompts or any(len(p) == 0 for p in prompts) or num_generations < 1:
        raise ValueError(f"{len(prompts)} prompt(s), each needing a token, and num_generations={num_generations} "
                         "(at least 1)")
    rows = [torch.tensor(p, dtype=torch.long) for p in prompts for _ in range(num_generations)]
    ids = pad_sequence(rows, batch_first=True, padding_value=pad_token_id, padding_side="left")
    mask = pad_sequence([torch.ones_like(r) for r in rows], batch_first=True, padding_value=0, padding_side="left")
    return ids, mask


def completion_mask(completion_ids, eos_token_ids: list[int]):
    """``(mask, truncated)``: 1 at each token up to and including its row's first EOS (TRL's mask), and
    whether the row has no EOS at all.

    Args:
        completion_ids: ``(rows, length)`` int64, the tokens generated after the prompt.
        eos_token_ids: the ids that end a completion.
    Returns:
        ``(rows, length)`` int64 and ``(rows,)`` bool.
    """
    import torch
    is_eos = torch.isin(completion_ids, torch.tensor(eos_token_ids, device=completion_ids.device))
    found = is_eos.any(dim=1)
    eos_idx = torch.where(found, is_eos.int().argmax(dim=1), torch.full_like(found, is_eos.size(1), dtype=torch.long))
    positions = torch.arange(is_eos.size(1), device=completion_ids.device).expand_as(is_eos)
    return (positions <= eos_idx.unsqueeze(1)).long(), ~found


@dataclass(frozen=True)
class Sampling:
    """How completions are sampled (TRL's ``GRPOConfig`` names; ``top_k`` 0 and ``top_p`` 1.0: off)."""
    num_generations: int = 8
    max_completion_length: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0


def sample(model, prompts: list[list[int]], sampling: Sampling, pad_token_id: int, eos_token_ids: list[int],
           seed: int | None) -> Generations:
    """``sampling.num_generations`` completions of each prompt from ``model``, drawn from generator state
    ``seed`` alone (the caller's RNG state is left as it was); ``seed`` None: greedy (no sampling, no RNG: the
    held-out figures', :mod:`onegpu.training.objectives.heldout_generation`).

    Args:
        model: a ``transformers`` causal LM (``generate``), in eval mode or not (dropout is switched off here
            and restored).
        prompts: the step's prompts as token ids.
        sampling: :class:`Sampling`.
        pad_token_id, eos_token_ids: the tokenizer's.
        seed: this step's seed (e.g. ``data.seed`` + the optimizer step).
    Returns:
        :class:`Generations`; tokens after a row's first EOS are set to ``pad_token_id``.
    """
    import torch
    from transformers import GenerationConfig
    device = next(model.parameters()).device
    ids, mask = left_padded(prompts, pad_token_id, sampling.num_generations)
    ids, mask = ids.to(device), mask.to(device)
    drawn = {} if seed is None else {"temperature": sampling.temperature, "top_p": sampling.top_p,
                                     "top_k": sampling.top_k}
    config = GenerationConfig(do_sample=seed is not None, **drawn, max_new_tokens=sampling.max_completion_length,
                              pad_token_id=pad_token_id, eos_token_id=list(eos_token_ids))
    training = model.training
    model.eval()
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
            if seed is not None:
                torch.manual_seed(seed)
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    finally:
        model.train(training)
    completion = out[:, ids.size(1):]
    cmask, truncated = completion_mask(completion, eos_token_ids)
    return Generations(ids, mask, completion.masked_fill(cmask == 0, pad_token_id), cmask, truncated)


def token_logps(model, gens: Generations, temperature: float = 1.0, rows=None):
    """Each completion token's log-probability under ``model`` at the sampling temperature: log-softmax of the
    logits / ``temperature`` at the position before it (TRL's), over the prompt and the completion (with grad
    when grad is on).

    Args:
        model: the causal LM (policy, old policy or reference).
        gens: :class:`Generations`.
        temperature: the sampling temperature (> 0).
        rows: the rows to score (a micro-batch: a slice or an index tensor); None: all.
    A train-mode model under the fused LM head (:func:`onegpu.training.objectives.lm_head.attach`) returns its hidden
    states; the completion positions' logits are then projected here (:func:`~onegpu.training.objectives.lm_head.
    last_logits`), as the model's own forward would.

    Returns:
        ``(rows, completion_length)`` float in the logits' dtype (float32 for bf16/fp16 logits); padding
        positions hold the pad token's log-probability (the loss masks them).
    """
    import torch
    rows = rows if rows is not None else slice(None)
    completion = gens.completion_ids[rows]
    ids = torch.cat([gens.prompt_ids[rows], completion], dim=1)
    mask = torch.cat([gens.prompt_mask[rows], gens.completion_mask[rows]], dim=1)
    length = completion.size(1)
    if model.training and lm_head.attached(getattr(model, "module", model)):  # the fused head: hidden states
        logits = lm_head.last_logits(model(input_ids=ids, attention_mask=mask), length + 1)[:, :-1]
    else:
        logits = model(input_ids=ids, attention_mask=mask, logits_to_keep=length + 1).logits[:, :-1]
    if logits.dtype in (torch.bfloat16, torch.float16):
        logits = logits.float()
    logps = (logits / temperature).log_softmax(dim=-1)
    return logps.gather(-1, completion.unsqueeze(-1)).squeeze(-1)
