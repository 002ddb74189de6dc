"""onegpu.training.objectives.generation: prompts repeated per group and left-padded, TRL's completion mask
(up to and including the first EOS), seeded sampling that leaves the caller's RNG alone, and the completion
tokens' log-probabilities at the sampling temperature equal to what generate sampled from (float64)."""
from __future__ import annotations

import pytest
import torch

from onegpu.training.objectives import generation

PAD = 0
EOS = list(range(1, 41))  # many end ids, so a tiny random model ends some completions early


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=True, pad_token_id=PAD)
    return LlamaForCausalLM(cfg).double()


PROMPTS = [[50, 51, 52, 53], [60, 61]]
SAMPLING = generation.Sampling(num_generations=3, max_completion_length=8, temperature=0.7)


def test_left_padded_repeats_each_prompt_contiguously():
    ids, mask = generation.left_padded(PROMPTS, PAD, 2)
    assert ids.tolist() == [[50, 51, 52, 53]] * 2 + [[0, 0, 60, 61]] * 2
    assert mask.tolist() == [[1, 1, 1, 1]] * 2 + [[0, 0, 1, 1]] * 2
    with pytest.raises(ValueError, match="each needing a token"):
        generation.left_padded([[5], []], PAD)


def test_completion_mask_keeps_up_to_the_first_eos_inclusive():
    ids = torch.tensor([[7, 2, 9, 2], [7, 8, 9, 10], [3, 7, 7, 7], [7, 7, 7, 2]])
    mask, truncated = generation.completion_mask(ids, [2, 3])
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 1]]
    assert truncated.tolist() == [False, True, False, False]


def test_sampling_is_seeded_and_leaves_the_callers_rng_alone():
    model = _tiny_llama().train()
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    a = generation.sample(model, PROMPTS, SAMPLING, PAD, EOS, seed=7)
    assert torch.equal(torch.rand(3), expected_next)  # the caller's stream did not move
    assert model.training  # dropout's mode restored
    b = generation.sample(model, PROMPTS, SAMPLING, PAD, EOS, seed=7)
    c = generation.sample(model, PROMPTS, SAMPLING, PAD, EOS, seed=8)
    assert torch.equal(a.completion_ids, b.completion_ids) and not torch.equal(a.completion_ids, c.completion_ids)
    assert a.prompt_ids.shape == (6, 4) and a.completion_ids.shape[0] == 6 and a.completion_ids.shape[1] <= 8
    lengths = a.lengths.tolist()
    assert min(lengths) < a.completion_ids.shape[1]  # some completion ended early: EOS kept, then padding
    for row, n in zip(a.completion_ids.tolist(), lengths):
        assert row[n - 1] in EOS or n == 8
        assert row[n:] == [PAD] * (len(row) - n)
    assert a.truncated.tolist() == [row[n - 1] not in EOS for row, n in zip(a.completion_ids.tolist(), lengths)]


def test_token_logps_are_what_generate_sampled_from_at_the_temperature():
    """generate's processed scores (logits / temperature, no top-k or top-p) give each sampled token the
    log-probability token_logps computes in one forward over prompt + completion, for the whole batch or any
    rows of it. generate casts each step's logits to float32 before sampling (transformers 5), so the two agree
    to float32's rounding (1e-6); the rows of one float64 forward agree with the whole to 1e-12."""
    model = _tiny_llama().eval()
    gens = generation.sample(model, PROMPTS, SAMPLING, PAD, EOS, seed=3)
    ids, mask = generation.left_padded(PROMPTS, PAD, SAMPLING.num_generations)
    from transformers import GenerationConfig
    with torch.random.fork_rng(), torch.no_grad():
        torch.manual_seed(3)
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=GenerationConfig(
            do_sample=True, temperature=0.7, top_k=0, top_p=1.0, max_new_tokens=8, pad_token_id=PAD,
            eos_token_id=EOS, return_dict_in_generate=True, output_scores=True))
    assert torch.equal(out.sequences[:, ids.shape[1]:].masked_fill(gens.completion_mask == 0, PAD),
                       gens.completion_ids)  # the same draw
    scores = torch.stack(out.scores, dim=1).double().log_softmax(-1)  # (rows, length, vocab)
    width = gens.completion_ids.shape[1]
    sampled = scores[:, :width].gather(-1, gens.completion_ids.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        logps = generation.token_logps(model, gens, temperature=0.7)
        part = generation.token_logps(model, gens, temperature=0.7, rows=slice(2, 5))
    m = gens.completion_mask.bool()
    assert logps.dtype == torch.float64 and logps.shape == gens.completion_ids.shape
    assert torch.allclose(logps[m], sampled[m], rtol=0, atol=1e-6)
    assert torch.allclose(part[gens.completion_mask[2:5].bool()], logps[2:5][m[2:5]], rtol=0, atol=1e-12)
