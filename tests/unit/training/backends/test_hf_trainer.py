"""HF Trainer backend on a causal LM: the logged step loss is the exact token mean over the step.

transformers 5.24's GPT-2 has ``loss_type`` None, so Trainer itself would count each row's first
token as a target and log (targets / (targets + rows)) x the true loss; onegpu counts the step's
targets itself (ExactLossTrainer.get_batch_samples). This test fails without that.
"""
from __future__ import annotations

import pytest
import torch
from datasets import ClassLabel, Dataset, DatasetDict

from onegpu import config
from onegpu.models import loader
from onegpu.training.backends import hf_trainer
from onegpu.training.backends.base import TrainRequest
from onegpu.training.objectives.batches import CausalLMCollator


def test_trainer_step_loss_equals_the_models_own_loss_over_the_effective_batch(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    texts = [" ".join(f"w{(i * 7 + j) % 50}" for j in range(5 + (i * 5) % 23)) for i in range(8)]
    tok = loader.train_bpe_tokenizer(texts, 300)
    ds = Dataset.from_dict({"text": texts, "label": ["x"] * 8}).cast_column("label", ClassLabel(names=["x"]))
    dsd = DatasetDict(train=ds, validation=ds, test=ds).map(
        lambda b: tok([t + tok.eos_token for t in b["text"]], truncation=True, max_length=32), batched=True)
    cfg = config.from_container({
        "model": {"task": "causal-lm", "name_or_path": None, "n_layer": 1, "n_embd": 32, "n_head": 2,
                  "vocab_size": 300, "dropout": 0.0},
        "train": {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "max_steps": 1,
                  "learning_rate": 1e-3, "logging_steps": 100}})
    torch.manual_seed(0)
    model = loader.build_causal_lm(None, tok, cfg.model, 32, 0.0)
    reference = type(model)(model.config)
    reference.load_state_dict(model.state_dict())
    losses = []
    hf_trainer.train(TrainRequest(model, tok, dsd, cfg, sink=lambda m, s: "loss" in m and losses.append(m["loss"])))

    # Step 1 covers all 8 rows (effective batch 8 = the whole set), whatever the sampler's order:
    # one batch of them through the model's own loss is the exact value.
    batch = CausalLMCollator(tok)([{"input_ids": r["input_ids"], "attention_mask": r["attention_mask"]}
                                   for r in dsd["train"]])
    reference.train()
    with torch.no_grad():
        exact = float(reference(**batch).loss)
    assert losses[0] == pytest.approx(exact, abs=1e-5)


def test_trainers_warning_of_another_micro_batch_alone_is_left_out_while_resuming():
    """compare_trainer_and_checkpoint_args' warning (its own text, transformers 5) when only the micro-batch differs
    is left out while a resume trains (onegpu's resume line says how the split changed); one naming another argument
    passes; outside a resume both pass."""
    import logging

    from transformers.trainer_callback import TrainerState
    from transformers.trainer_utils import compare_trainer_and_checkpoint_args
    args = type("Args", (), {"per_device_train_batch_size": 4, "n_gpu": 0, "logging_steps": 1, "eval_steps": None,
                             "save_steps": 10})
    only_split, more = TrainerState(train_batch_size=8, logging_steps=1, save_steps=10), TrainerState(
        train_batch_size=8, logging_steps=2, save_steps=10)
    from tests.unit.tiny import logged_by
    with logged_by("transformers.trainer_utils") as said:
        for resuming in (True, False):
            for state in (only_split, more):
                logging.Logger.warning_once.cache_clear()  # Trainer warns once per process and message
                with hf_trainer.same_effective_batch_unsaid(resuming):
                    compare_trainer_and_checkpoint_args(args, state)
    split = "per_device_train_batch_size: 4 (from args) != 8 (from trainer_state.json)"
    assert [split in m for m in said] == [True, True, True], said  # resuming: the warning of `more` alone
    assert ["logging_steps: 1 (from args) != 2" in m for m in said] == [True, False, True], said
