"""Exactness of the step loss and gradient under accumulation (onegpu.training.objectives.loss).

One optimizer step over 8 rows of different lengths, as one batch of 8 or as micro-batches of 4x2 and
2x4 each padded to its own longest row: the summed loss contributions and accumulated gradients must
equal the one-batch values to float32 rounding. The per-micro-batch mean (what a plain accumulation
loop computes) must not: that is what makes these tests able to fail.
"""
from __future__ import annotations

import pytest
import torch

from onegpu.training.objectives import count_items
from onegpu.training.objectives.loss import causal_lm_loss, classification_loss

torch.manual_seed(0)
LENGTHS = [3, 17, 5, 9, 30, 2, 12, 7]


def _rows(vocab: int):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(2, vocab, (n,), generator=g) for n in LENGTHS]


def _pad(rows, pad_id=0):
    n = max(len(r) for r in rows)
    ids = torch.full((len(rows), n), pad_id)
    mask = torch.zeros((len(rows), n), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = r
        mask[i, :len(r)] = 1
    return ids, mask


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg).eval()


def _bert():
    from transformers import BertConfig, BertForSequenceClassification
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=32, num_labels=3,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return BertForSequenceClassification(cfg).eval()


def _step(model, rows, targets, micro: int, task: str, naive: bool = False):
    """One optimizer step's (loss, flat gradient) with micro-batches of ``micro`` rows."""
    model.zero_grad()
    chunks = [list(range(i, min(i + micro, len(rows)))) for i in range(0, len(rows), micro)]
    batches = []
    for idx in chunks:
        ids, mask = _pad([rows[i] for i in idx])
        labels = ids.masked_fill(mask == 0, -100) if task == "causal-lm" else targets[idx]
        batches.append((ids, mask, labels))
    n_items = sum(count_items(b[2], task) for b in batches)
    fn = causal_lm_loss if task == "causal-lm" else classification_loss
    total = 0.0
    for ids, mask, labels in batches:
        out = model(input_ids=ids, attention_mask=mask)
        loss = fn(out, labels) / len(batches) if naive else fn(out, labels, n_items)
        loss.backward()
        total += loss.item()
    grad = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return total, grad


@pytest.mark.parametrize("task", ["causal-lm", "sequence-classification"])
def test_accumulated_step_equals_one_batch(task):
    model = _gpt2() if task == "causal-lm" else _bert()
    rows = _rows(64)
    targets = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    ref_loss, ref_grad = _step(model, rows, targets, 8, task)
    for micro in (4, 2, 1):
        loss, grad = _step(model, rows, targets, micro, task)
        assert loss == pytest.approx(ref_loss, abs=2e-6), micro
        assert torch.allclose(grad, ref_grad, atol=1e-6, rtol=1e-4), (micro, (grad - ref_grad).abs().max())


def test_mean_of_micro_batch_means_is_not_exact_for_causal_lm():
    model = _gpt2()
    rows = _rows(64)
    ref_loss, ref_grad = _step(model, rows, None, 8, "causal-lm")
    naive_loss, naive_grad = _step(model, rows, None, 2, "causal-lm", naive=True)
    # Rows of 2..30 tokens weigh unequally per micro-batch: 100x past the exact path's tolerance.
    assert abs(naive_loss - ref_loss) > 2e-4
    assert (naive_grad - ref_grad).abs().max() > 1e-4


def test_count_items_is_shift_aware():
    labels = torch.tensor([[5, 6, 7, -100], [8, 9, -100, -100]])
    assert int(count_items(labels, "causal-lm")) == 3  # first token of each row is no target
    assert int(count_items(torch.tensor([1, -100, 2]), "sequence-classification")) == 2


def test_causal_lm_loss_matches_transformers_own_loss_on_one_batch():
    model = _gpt2()
    ids, mask = _pad(_rows(64))
    labels = ids.masked_fill(mask == 0, -100)
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    assert float(causal_lm_loss(out, labels).detach()) == pytest.approx(float(out.loss.detach()), abs=1e-6)
