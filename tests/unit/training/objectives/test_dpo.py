"""onegpu.training.objectives.dpo: TRL's per-pair losses, sequence log-probabilities the same through the whole
logits and the fused LM head (float64), the step's loss a sum over pairs divided by the step's pairs (and by
how much TRL's per-micro-batch mean differs on an uneven split), TRL's figures with ties apart."""
from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from onegpu.config import DPOConfig  # noqa: E402
from onegpu.training.objectives import dpo, lm_head  # noqa: E402

F = torch.nn.functional


def logps(*pairs):
    """(2 pairs,) float64 from (chosen, rejected) tuples."""
    return torch.tensor([x for p in pairs for x in p], dtype=torch.float64)


POLICY, REFERENCE = logps((-3.0, -5.0), (-7.0, -6.5), (-2.0, -2.0)), logps((-4.0, -4.0), (-6.0, -6.0), (-2.0, -2.0))
TOKENS = torch.tensor([3, 5, 7, 4, 2, 2])


@pytest.mark.parametrize("loss_type", ["sigmoid", "hinge", "ipo", "robust", "sft", "sigmoid_norm"])
def test_each_loss_type_is_trls_formula(loss_type):
    d = DPOConfig(beta=0.2, loss_type=[loss_type], label_smoothing=0.1)
    c, r = POLICY[0::2] - REFERENCE[0::2], POLICY[1::2] - REFERENCE[1::2]
    delta, b, e = c - r, 0.2, 0.1
    avg = c / TOKENS[0::2] - r / TOKENS[1::2]
    expected = {"sigmoid": -F.logsigmoid(b * delta), "hinge": torch.relu(1 - b * delta),
                "ipo": (avg - 1 / (2 * b)) ** 2,
                "robust": (-(1 - e) * F.logsigmoid(b * delta) + e * F.logsigmoid(-b * delta)) / (1 - 2 * e),
                "sft": -POLICY[0::2] / TOKENS[0::2], "sigmoid_norm": -F.logsigmoid(b * avg)}[loss_type]
    assert torch.allclose(dpo.pair_losses(POLICY, REFERENCE, TOKENS, d), expected, rtol=0, atol=1e-15)


def test_several_loss_types_are_summed_with_their_weights():
    one = {t: dpo.pair_losses(POLICY, REFERENCE, TOKENS, DPOConfig(loss_type=[t])) for t in ("sigmoid", "sft")}
    both = dpo.pair_losses(POLICY, REFERENCE, TOKENS, DPOConfig(loss_type=["sigmoid", "sft"], loss_weights=[0.8, 0.2]))
    assert torch.allclose(both, 0.8 * one["sigmoid"] + 0.2 * one["sft"], rtol=0, atol=1e-15)


def test_policy_equal_to_reference_gives_ln2_zero_rewards_and_ties_counted_apart():
    f = dpo.figures(POLICY, POLICY.clone(), 0.1)
    assert float(dpo.step_share(dpo.pair_losses(POLICY, POLICY.clone(), TOKENS, DPOConfig()), None)) == math.log(2)
    assert {k: float(v) for k, v in f.items()} == {
        "rewards/chosen": 0.0, "rewards/rejected": 0.0, "rewards/accuracies": 0.0, "rewards/ties": 3.0,
        "rewards/margins": 0.0, "logps/chosen": -12.0, "logps/rejected": -13.5}


def test_figures_are_sums_over_the_pairs():
    f = dpo.figures(POLICY, REFERENCE, 0.5)  # rewards: (0.5, -0.5), (-0.5, -0.25), (0, 0)
    assert {k: float(v) for k, v in f.items()} == {
        "rewards/chosen": 0.0, "rewards/rejected": -0.75, "rewards/accuracies": 1.0, "rewards/ties": 1.0,
        "rewards/margins": 0.75, "logps/chosen": -12.0, "logps/rejected": -13.5}


def test_a_step_is_its_pairs_mean_however_split_and_trl_differs_on_an_uneven_split():
    """7 pairs as 4 + 3: each micro-batch's sum over the step's 7 pairs adds up to the 7-pair mean; TRL's
    mean per micro-batch divided by the accumulation count weighs the 3 pairs' by 1/6 and the 4 by 1/8."""
    losses = torch.tensor([0.9, 0.1, 0.4, 0.7, 0.2, 0.6, 0.3], dtype=torch.float64)
    ours = dpo.step_share(losses[:4], 7) + dpo.step_share(losses[4:], 7)
    trl = losses[:4].mean() / 2 + losses[4:].mean() / 2
    assert float(ours) == pytest.approx(float(losses.mean()), abs=1e-15)
    assert float(trl - losses.mean()) == pytest.approx(-0.0113095238, abs=1e-9)  # 2.1 / 8 + 1.1 / 6 - 3.2 / 7


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).double()


def test_sequence_logps_are_the_same_through_the_fused_head_and_padded_or_flattened():
    from onegpu.training.objectives.dpo import PreferenceCollator
    model = _tiny_llama()
    rows = [{"prompt_ids": [5, 6, 7], "chosen_ids": [8, 9], "rejected_ids": [10, 11, 12, 13]},
            {"prompt_ids": [14], "chosen_ids": [15, 16, 17], "rejected_ids": [18]}]
    padded, flat = PreferenceCollator(0)(rows), PreferenceCollator(0, flattened=True)(rows)
    feats = {k: v for k, v in padded.items() if k != "labels"}
    whole, tokens = dpo.sequence_logps(model(**feats), padded["labels"], dpo.sequence_ids(padded), 4)
    assert tokens.tolist() == [2, 4, 3, 1]
    with torch.no_grad():  # each sequence alone, by hand
        for i, (p, a) in enumerate([(r["prompt_ids"], r[k]) for r in rows for k in ("chosen_ids", "rejected_ids")]):
            lp = model(input_ids=torch.tensor([p + a])).logits[0, :-1].log_softmax(-1)
            alone = sum(float(lp[len(p) - 1 + j, t]) for j, t in enumerate(a))
            assert float(whole[i]) == pytest.approx(alone, rel=1e-12)
    lm_head.attach(model)
    model.train()
    fused, _ = dpo.sequence_logps(model(**feats), padded["labels"], dpo.sequence_ids(padded), 4)
    flat_feats = {k: v for k, v in flat.items() if k != "labels"}
    flattened, _ = dpo.sequence_logps(model(**flat_feats), flat["labels"], dpo.sequence_ids(flat), 4)
    assert torch.allclose(fused, whole, rtol=1e-12, atol=0) and torch.allclose(flattened, whole, rtol=1e-12, atol=0)
