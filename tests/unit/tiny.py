"""Tiny training fixtures shared by the unit tests: the packaged MiniLM tokenizer, a small 3-label
dataset of texts of different lengths, a 2-layer BERT classifier built from config, and a stop that
"arrives" during optimizer step 2. Not a test module."""
from __future__ import annotations

import contextlib
import functools

import pytest

from onegpu.config import PACKAGED_MODEL
from onegpu.models import loader

LOSS_TOL, NORM_TOL = 1e-5, 1e-4
WORDS = ("market shares rose after the bank cut rates while the minister spoke about growth and the team "
         "won the final match in extra time as the crowd sang and a new film opened to good reviews").split()


@functools.cache
def tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(loader.resolve_model_path(PACKAGED_MODEL))


@functools.cache
def dataset(n: int):
    """``n`` texts of 2..25 words (micro-batches pad to different lengths), 3 labels, tokenized as prepare
    does (``onegpu.data.tokenize``: unpadded, ``label`` a ClassLabel)."""
    from datasets import ClassLabel, Dataset, DatasetDict

    from onegpu.data import tokenize
    texts = [" ".join((WORDS * 2)[(5 * i) % len(WORDS):][: 2 + (7 * i) % 24]) for i in range(n)]
    labels = [["business", "sport", "entertainment"][(i * 2) % 3] for i in range(n)]
    ds = Dataset.from_dict({"text": texts, "label": labels}).cast_column(
        "label", ClassLabel(names=["business", "entertainment", "sport"]))
    return tokenize(DatasetDict(train=ds), tokenizer(), max_length=32)


def interrupt_at_step_2(train, ckpt):
    """``train(sink, checkpoint_dir=, stop=, checkpoint_meta=)`` stopped by a signal that "arrives"
    during optimizer step 2 (a GracefulStop stand-in); it must raise Interrupted. Returns the losses the
    sink saw and the checkpoint left in ``ckpt`` (None if none)."""
    from onegpu.training.lifecycle.interrupt import Interrupted
    from onegpu.training.lifecycle.resume import latest_checkpoint

    class Stop:
        requested = None
    stop, first = Stop(), []

    def sink(m, s):
        first.append(m["loss"])
        if s == 2:
            stop.requested = 2
    with pytest.raises(Interrupted):
        train(sink, checkpoint_dir=ckpt, stop=stop, checkpoint_meta={"run_id": "r1"})
    return first, latest_checkpoint(ckpt)


def tiny_bert(attn: str | None = None, intermediate_size: int = 64):
    """A 2-layer BERT classifier (hidden 32), seeded. ``intermediate_size`` 128 makes each layer's two
    feed-forward weights 4,096 elements: large enough for the low-bit optimizers to quantise their states."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification
    torch.manual_seed(0)
    config = BertConfig(**({} if attn is None else {"attn_implementation": attn}),
                        vocab_size=tokenizer().vocab_size, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=intermediate_size, max_position_embeddings=64,
                        num_labels=3,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                        pad_token_id=tokenizer().pad_token_id)
    return BertForSequenceClassification(config)


def low_bit_step(optim: str):
    """One eager step of torchao's ``AdamW8bit``/``AdamW4bit`` (block size 256, as Trainer builds them) on a
    256x256 + 256x64 Linear stack with biases; returns (model, optimizer)."""
    import torch
    from torchao.optim import AdamW4bit, AdamW8bit
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 64))
    opt = (AdamW8bit if optim == "adamw_torch_8bit" else AdamW4bit)(model.parameters(), lr=1e-3, block_size=256)
    model(torch.randn(4, 256)).square().mean().backward()
    with torch.compiler.set_stance("force_eager"):  # the states' bytes do not depend on the compiled step
        opt.step()
    return model, opt


@contextlib.contextmanager
def logged_by(name: str):
    """The messages logger ``name`` lets through while the block runs (after the logger's own filters), as a list.
    pytest's caplog does not see transformers' loggers: its library root logger does not propagate."""
    import logging
    said, handler, log = [], logging.Handler(), logging.getLogger(name)
    handler.emit = lambda record: said.append(record.getMessage())
    log.addHandler(handler)
    try:
        yield said
    finally:
        log.removeHandler(handler)
