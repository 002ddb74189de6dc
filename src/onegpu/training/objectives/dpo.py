"""Direct preference optimization (DPO) and its kin: the per-pair losses, the optimizer step's loss exact
under gradient accumulation, and TRL's figures (TRL 1.16 ``DPOTrainer``'s definitions and metric names).

**Pairs in a micro-batch.** Sequences 2i and 2i + 1 of a micro-batch are pair i's chosen and rejected answer
after their prompt: rows 2i and 2i + 1 when padded, or sequences 2i and 2i + 1 of one flattened row
(padding-free, ``position_ids`` restarting at 0 for each; :class:`PreferenceCollator`).

**Sequence log-probabilities** (:func:`sequence_logps`): the sum of the answer tokens' next-token
log-probabilities (the prompt's labels are -100), each computed in float32 (float64 for a float64 model) from
the whole logits or the fused LM head's tiles (:func:`onegpu.training.objectives.lm_head.token_nll`, the same value per
token), summed in that dtype in token order. The reference model's the same way, under ``torch.no_grad()``.

**The loss.** Per pair, ``delta = (chosen - ref_chosen) - (rejected - ref_rejected)`` (TRL's ``reverse_kl``
scores); each ``train.dpo.loss_type`` gives a per-pair loss (:func:`pair_losses`), weighted by
``train.dpo.loss_weights``. The optimizer step's loss is the sum of the per-pair losses over the whole step
(every micro-batch, every process) divided by the pairs in the step: each micro-batch contributes its sum
divided by that count (:func:`step_share`), so any split of the step gives the same loss and gradient. TRL
divides each micro-batch's *mean* by the accumulation count instead, weighing a pair by 1 / (pairs in its
micro-batch x accumulation): the same only when every micro-batch holds as many pairs. TRL's ``sft`` term is
a token mean per micro-batch; here it is each chosen answer's token mean, averaged over the step's pairs.
"""
from __future__ import annotations

from onegpu.data.chat import IGNORE_INDEX
from onegpu.training.objectives import lm_head

# TRL's metric names, per optimizer step and per held-out split (eval_/test_ prefixed); ties counted apart.
FIGURES = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/ties", "rewards/margins",
           "logps/chosen", "logps/rejected")


def scoring_output(model, features: dict):
    """``model``'s output for ``features`` (no ``labels``) in its current mode, for :func:`sequence_logps`:
    hidden states where the fused LM head is attached (:func:`onegpu.training.objectives.lm_head.attach`: no whole
    logits), else the model's own output. The reference's forward, held-out scoring and the reference stage's."""
    if lm_head.attached(model):
        return lm_head.hidden_states(model, features)
    return model(**features, use_cache=False)


def sequence_ids(inputs: dict):
    """Each position's sequence index, ``(rows, seq_len)`` int64: the row for a padded micro-batch; for a
    flattened one (``position_ids``, no ``attention_mask``) the count of sequence starts up to it, minus 1."""
    import torch
    ids = inputs["input_ids"]
    if inputs.get("attention_mask") is None and inputs.get("position_ids") is not None:
        return inputs["position_ids"].eq(0).cumsum(-1) - 1
    return torch.arange(ids.shape[0], device=ids.device)[:, None].expand(ids.shape)


def sequence_logps(outputs, labels, seq_ids, n_seqs: int):
    """``(logps, tokens)``: each sequence's summed answer-token log-probability, ``(n_seqs,)`` float32
    (float64 for a float64 model), and its target count, ``(n_seqs,)`` int64.

    Args:
        outputs: the model's output (``logits`` ``(rows, seq_len, vocab)``) or its
            :class:`~onegpu.training.objectives.lm_head.HiddenStates` (the fused LM head).
        labels: ``(rows, seq_len)`` int64, unshifted, -100 where no target (prompt, padding).
        seq_ids: :func:`sequence_ids` of the micro-batch.
    """
    import torch
    import torch.nn.functional as F
    mask = labels[:, 1:].ne(IGNORE_INDEX)
    owner = seq_ids[:, 1:][mask]  # the sequence of each target, in row-major order
    if isinstance(outputs, lm_head.HiddenStates):
        nll = lm_head.token_nll(outputs, labels)[:owner.shape[0]]  # (its aligned tail dropped: no sync)
    else:
        logits = outputs["logits"] if isinstance(outputs, dict) else outputs.logits
        nll = F.cross_entropy(lm_head.upcast(logits[:, :-1][mask]), labels[:, 1:][mask], reduction="none")
    logps = torch.zeros(n_seqs, dtype=nll.dtype, device=nll.device).index_add(0, owner, -nll)
    tokens = torch.zeros(n_seqs, dtype=torch.int64, device=nll.device).index_add(0, owner, torch.ones_like(owner))
    return logps, tokens


def pair_losses(policy, reference, tokens, dpo):
    """The per-pair loss ``(pairs,)`` of ``train.dpo`` (``dpo``: :class:`onegpu.config.DPOConfig`), TRL 1.16's
    definitions: sigmoid ``-log sigmoid(beta delta)``; hinge ``relu(1 - beta delta)``; ipo
    ``(delta' - 1 / (2 beta))^2`` and sigmoid_norm ``-log sigmoid(beta delta')`` with ``delta'`` the log-ratios
    averaged per answer token; robust ``((1 - e) l(delta) - e l(-delta)) / (1 - 2 e)``, ``l(x) = -log
    sigmoid(beta x)``, ``e = label_smoothing``; sft ``-chosen / chosen tokens``. Several are summed, each
    times its weight (``loss_weights``, null = 1).

    Args:
        policy, reference: ``(2 pairs,)`` sequence log-probabilities (chosen, rejected alternating).
        tokens: ``(2 pairs,)`` answer tokens per sequence.
    """
    import torch.nn.functional as F
    ratios = policy - reference
    chosen, rejected = ratios[0::2], ratios[1::2]
    per_token = ratios / tokens.clamp(min=1).to(ratios.dtype)
    delta, delta_avg, beta, e = chosen - rejected, per_token[0::2] - per_token[1::2], dpo.beta, dpo.label_smoothing
    terms = {
        "sigmoid": lambda: -F.logsigmoid(beta * delta),
        "hinge": lambda: (1 - beta * delta).relu(),
        "ipo": lambda: (delta_avg - 1 / (2 * beta)) ** 2,
        "robust": lambda: ((1 - e) * -F.logsigmoid(beta * delta) - e * -F.logsigmoid(-beta * delta)) / (1 - 2 * e),
        "sft": lambda: -policy[0::2] / tokens[0::2].clamp(min=1).to(policy.dtype),
        "sigmoid_norm": lambda: -F.logsigmoid(beta * delta_avg),
    }
    weights = dpo.loss_weights or [1.0] * len(dpo.loss_type)
    losses = [terms[t]() * w for t, w in zip(dpo.loss_type, weights)]
    return sum(losses[1:], losses[0])


def figures(policy, reference, beta: float) -> dict:
    """TRL's figures of some pairs as sums over them (0-dim tensors in the log-probabilities' dtype;
    divide by the pairs for TRL's means): ``rewards/chosen`` and ``rewards/rejected`` (``beta`` x the
    log-ratio to the reference), ``rewards/accuracies`` (pairs whose chosen reward is the larger: a tie is
    not), ``rewards/ties``, ``rewards/margins`` (chosen minus rejected reward), ``logps/chosen``,
    ``logps/rejected`` (the policy's). ``policy``, ``reference``: ``(2 pairs,)``, chosen and rejected alternating."""
    rewards = beta * (policy - reference).detach()
    chosen, rejected = rewards[0::2], rewards[1::2]
    logps = policy.detach()
    values = (chosen.sum(), rejected.sum(), chosen.gt(rejected).sum(), chosen.eq(rejected).sum(),
              (chosen - rejected).sum(), logps[0::2].sum(), logps[1::2].sum())
    return {k: v.to(rewards.dtype) for k, v in zip(FIGURES, values)}


def step_share(losses, num_pairs):
    """One micro-batch's share of the optimizer step's loss: its per-pair losses summed, divided by the pairs
    in the whole step ``num_pairs`` (all micro-batches and processes; None: this micro-batch's). 0-dim."""
    return losses.sum() / (losses.shape[0] if num_pairs is None else num_pairs)


class PreferenceCollator:
    """Preference pairs (``prompt_ids``, ``chosen_ids``, ``rejected_ids`` per row,
    :mod:`onegpu.data.preference`) as one micro-batch of 2 x pairs sequences, pair i's chosen then its
    rejected answer after the prompt (TRL's ``DataCollatorForPreference`` puts all chosen first; alternating,
    a cut between rows keeps pairs whole): padded to the longest (right) with ``input_ids``,
    ``attention_mask`` and ``labels`` ``(2 pairs, longest)`` int64, or (``flattened``) one row of them all
    with ``position_ids`` restarting at 0 per sequence and no attention mask (padding-free).

    Masks come from the lengths, never from the pad id (SmolLM2's pad is its EOS, which ends each answer and
    is a target): ``labels`` are the answer's ids, -100 on the prompt and on padding. Rows with precomputed
    reference log-probabilities (``ref_chosen_logps``, ``ref_rejected_logps``) add ``ref_logps`` ``(2 pairs,)``
    float64, in the sequences' order.
    """

    def __init__(self, pad_token_id: int, flattened: bool = False) -> None:
        self.pad, self.flattened = pad_token_id, flattened

    def __call__(self, features: list[dict]) -> dict:
        import torch
        seqs, labels = [], []
        for f in features:
            prompt = list(f["prompt_ids"])
            for answer in (f["chosen_ids"], f["rejected_ids"]):
                seqs.append(prompt + list(answer))
                labels.append([IGNORE_INDEX] * len(prompt) + list(answer))
        # precomputed reference log-probabilities (train.dpo.precompute_ref_log_probs): (2 pairs,) float64
        ref = {}
        if "ref_chosen_logps" in features[0]:
            pairs = [(f["ref_chosen_logps"], f["ref_rejected_logps"]) for f in features]
            ref["ref_logps"] = torch.tensor([x for p in pairs for x in p], dtype=torch.float64)
        if self.flattened:
            positions = [torch.arange(len(s)) for s in seqs]
            return {"input_ids": torch.tensor([t for s in seqs for t in s])[None],
                    "labels": torch.tensor([t for row in labels for t in row])[None],
                    "position_ids": torch.cat(positions)[None], **ref}
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        lab = torch.full((len(seqs), width), IGNORE_INDEX, dtype=torch.long)
        for i, (s, row) in enumerate(zip(seqs, labels)):
            ids[i, :len(s)], mask[i, :len(s)], lab[i, :len(s)] = torch.tensor(s), 1, torch.tensor(row)
        return {"input_ids": ids, "attention_mask": mask, "labels": lab, **ref}
