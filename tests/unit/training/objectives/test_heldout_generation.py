"""onegpu.training.objectives.heldout_generation: GRPO's held-out figures. Greedy completions are the model's
own (the same twice, its mode restored); the pass rate is the share of prompts whose final answer is the row's,
the reward the mean weighted sum of the reward functions' scores."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from onegpu.training.objectives import generation, heldout_generation  # noqa: E402
from tests.unit.equivalence import float64  # noqa: E402


def test_greedy_completions_are_deterministic_and_leave_the_mode():
    cfg, _ = float64.grpo_config({"per_device_train_batch_size": 4})
    model, data = float64.grpo_model(cfg, 3)
    model.train()
    tok = float64.chat_tokenizer()
    args = (data["train"]["prompt_ids"], 5, tok.pad_token_id, generation.eos_ids(tok, model))
    a, b = heldout_generation.greedy(model, *args), heldout_generation.greedy(model, *args)
    assert model.training and torch.equal(a.completion_ids, b.completion_ids)
    assert a.completion_ids.shape[0] == 3 and 1 <= int(a.lengths.min()) <= int(a.lengths.max()) <= 5


def test_the_pass_rate_counts_final_answers_and_the_reward_weighs_the_functions(monkeypatch):
    """Completions planted by a stand-in for greedy: 2 of 3 end with their row's answer."""
    cfg, _ = float64.grpo_config({"per_device_train_batch_size": 4},
                                 {"reward_weights": [2.0], "max_completion_length": 8})
    model, data = float64.grpo_model(cfg, 3)
    tok = float64.chat_tokenizer()
    split = data["train"]
    texts = [f"so it is {split['answer'][0]}", "no idea", f"<answer>{split['answer'][2]}</answer>"]

    def planted(model, prompts, max_new_tokens, pad, eos):
        ids = [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in texts]
        width = max(map(len, ids))
        completion = torch.tensor([i + [pad] * (width - len(i)) for i in ids])
        mask, truncated = generation.completion_mask(completion, [tok.eos_token_id])
        p, pm = generation.left_padded(prompts, pad)
        return generation.Generations(p, pm, completion, mask, truncated)
    monkeypatch.setattr(heldout_generation, "greedy", planted)
    funcs = {"text_reward": float64.text_reward}
    out = heldout_generation.figures(model, tok, split, cfg, "cpu", "test", funcs)
    assert out["test_pass_rate"] == 2 / 3 and out["test_prompts"] == 3
    want = sum(2.0 * r for r in float64.text_reward(None, texts, split["answer"])) / 3
    assert abs(out["test_reward"] - want) <= 1e-15
