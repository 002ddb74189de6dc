"""Pieces of the train stage (onegpu.stages.train) that need no data or store."""
from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from onegpu.models import loader  # noqa: E402
from onegpu.stages import train as train_stage  # noqa: E402


def test_saved_causal_lm_gets_its_kv_cache_back_after_checkpointed_training(tmp_path):
    """Issue 9 case 8: training with checkpointing (and HF Trainer, always) sets ``use_cache: false``;
    the saved ``config.json`` must keep the model's own value, or generation from it runs without a cache."""
    from transformers import GPT2Config, GPT2LMHeadModel
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=32, n_embd=32, n_layer=1, n_head=2,
                                       bos_token_id=0, eos_token_id=0))
    before = {"use_cache": model.config.use_cache}
    assert before == {"use_cache": True}
    loader.enable_checkpointing(model)
    assert model.config.use_cache is False
    train_stage._save_model(model, tmp_path, before)
    assert json.loads((tmp_path / "config.json").read_text())["use_cache"] is True
