"""Checkpointing granularity (train.gradient_checkpointing_kwargs / gradient_checkpointing_blocks):
every setting trains the same steps as no checkpointing on both backends, keeps fewer activations
than none, is validated with one line per key, and leaves the equivalence key alone."""
from __future__ import annotations

import importlib
import warnings

import pytest

torch = pytest.importorskip("torch")

from onegpu.config import TrainConfig, from_container, resolve  # noqa: E402
from onegpu.errors import ConfigError, ModelError  # noqa: E402
from onegpu.measure import memory  # noqa: E402
from onegpu.training.memory import checkpointing  # noqa: E402
from onegpu.training.objectives.loss import causal_lm_loss, classification_loss  # noqa: E402
from tests.unit.tiny import dataset, tiny_bert, tokenizer  # noqa: E402

# (every_n_layers, blocks, use_reentrant): the settings the tests run
SETTINGS = [(1, "layer", False), (2, "layer", False), (1, "layer", True), (1, "attention", False),
            (1, "mlp", False), (2, "attention", True), (1, "mlp", True)]


def train_cfg(every=1, blocks="layer", reentrant=False, on=True) -> TrainConfig:
    return from_container({"train": {"gradient_checkpointing": on, "gradient_checkpointing_blocks": blocks,
                                     "gradient_checkpointing_kwargs": {"use_reentrant": reentrant,
                                                                       "every_n_layers": every}}}).train


def losses(backend: str, setting) -> tuple[list[float], int]:
    """Per-step losses of 3 optimizer steps (4 x 2) of the tiny BERT and the recorder's
    ``mem_activation_bytes``; ``setting`` None = no checkpointing."""
    every, blocks, reentrant = setting or (1, "layer", False)
    cfg = from_container({
        "model": {"dropout": 0.0},
        "train": {"backend": backend, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2,
                  "max_steps": 3, "learning_rate": 1e-3, "seed": 7, "gradient_checkpointing": setting is not None,
                  "gradient_checkpointing_blocks": blocks,
                  "gradient_checkpointing_kwargs": {"use_reentrant": reentrant, "every_n_layers": every}},
    }, source="test")
    from onegpu.training.backends import base
    module = importlib.import_module(base.REGISTRY[backend])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, steps = module.train(base.TrainRequest(tiny_bert(), tokenizer(), dataset(24), cfg, sink=lambda m, s: None))
    return [r["loss"] for r in steps.rows], steps.breakdown["mem_activation_bytes"]


@pytest.mark.parametrize("backend", ["accelerate", "trainer"])
def test_every_granularity_trains_the_same_steps_as_no_checkpointing(backend):
    ref, ref_bytes = losses(backend, None)
    assert len(ref) == 3
    for setting in [(2, "layer", False), (1, "attention", False), (1, "mlp", True)]:
        got, act = losses(backend, setting)
        assert got == pytest.approx(ref, abs=1e-6), (setting, got, ref)
        assert 0 < act < ref_bytes, (setting, act, ref_bytes)  # the backend did checkpoint as asked


def test_a_transformers_without_activation_checkpointing_still_checkpoints(monkeypatch, tmp_path):
    """transformers before the rename (5.17, the lent GPU machine's) has no TrainingArguments
    ``activation_checkpointing``, and its ``gradient_checkpointing_kwargs`` cannot carry every_n_layers:
    Trainer's switch is not passed and the backend checkpoints the model itself, the same steps."""
    from onegpu.training.backends import hf_trainer
    ref, ref_bytes = losses("trainer", None)
    monkeypatch.setattr(hf_trainer, "TRAINER_CHECKPOINTS", False)
    cfg = from_container({"train": {"gradient_checkpointing": True,
                                    "gradient_checkpointing_kwargs": {"every_n_layers": 2}}}, source="test")
    args = hf_trainer.training_arguments(cfg, str(tmp_path))
    assert not getattr(args, "activation_checkpointing", False) and not args.gradient_checkpointing
    for setting in [(2, "layer", False), (1, "layer", True)]:
        got, act = losses("trainer", setting)
        assert got == pytest.approx(ref, abs=1e-6), (setting, got, ref)
        assert 0 < act < ref_bytes, (setting, act, ref_bytes)


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=97, n_positions=32, n_embd=32, n_layer=4, n_head=2,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def gpt2_batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 97, (4, 24), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def sgd_losses(model, batch, loss_fn, steps: int = 3) -> list[float]:
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    out = []
    for _ in range(steps):
        labels = batch["labels"]
        loss = loss_fn(model(**{k: v for k, v in batch.items() if k != "labels"}), labels)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def test_gpt2_every_granularity_gives_the_same_losses():
    ref = sgd_losses(tiny_gpt2(), gpt2_batch(), causal_lm_loss)
    for setting in SETTINGS:
        model = tiny_gpt2()
        checkpointing.enable(model, train_cfg(*setting))
        got = sgd_losses(model, gpt2_batch(), causal_lm_loss)
        assert got == pytest.approx(ref, abs=1e-6), (setting, got, ref)


def bert4():
    from transformers import BertConfig, BertForSequenceClassification
    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(
        vocab_size=tokenizer().vocab_size, hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
        intermediate_size=128, max_position_embeddings=64, num_labels=3, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, pad_token_id=tokenizer().pad_token_id))


def bert_batch():
    texts = [("word " * n).strip() for n in (30, 20, 32, 10)]
    batch = dict(tokenizer()(texts, truncation=True, max_length=32, padding=True, return_tensors="pt"))
    batch["labels"] = torch.tensor([0, 1, 2, 0])
    return batch


def act_bytes(build, batch, loss_fn, setting) -> int:
    model = build()
    if setting is not None:
        checkpointing.enable(model, train_cfg(*setting))
    return memory.activation_bytes(model, batch, loss_fn)


@pytest.mark.parametrize("arch", ["bert", "gpt2"])
def test_activation_bytes_follow_the_granularity(arch):
    build, batch, loss_fn = ((bert4, bert_batch(), classification_loss) if arch == "bert"
                             else (tiny_gpt2, gpt2_batch(), causal_lm_loss))
    b = {s: act_bytes(build, batch, loss_fn, s) for s in
         [None, (1, "layer", False), (2, "layer", False), (1, "attention", False), (1, "mlp", False),
          (2, "attention", False), (1, "layer", True)]}
    none, full, half = b[None], b[(1, "layer", False)], b[(2, "layer", False)]
    print(arch, {str(k): v for k, v in b.items()})
    assert none > half > full > 0, b
    assert none > b[(1, "attention", False)] > full, b
    assert none > b[(1, "mlp", False)] > full, b
    assert b[(1, "attention", False)] < b[(2, "attention", False)] < none, b
    assert b[(1, "layer", True)] == full  # reentrant or not, the same tensors stay
    # the layers checkpointed by every_n_layers 2 are half of them: about half of full's saving
    assert (none - half) == pytest.approx((none - full) / 2, rel=0.25), b


def test_sub_blocks_on_an_unsupported_architecture_are_one_error():
    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)
    with pytest.raises(ModelError, match=r"^train.gradient_checkpointing_blocks: 'mlp' needs a BERT-style "
                                         r"encoder or GPT-2; Tiny has neither"):
        checkpointing.enable(Tiny(), train_cfg(1, "mlp"))


@pytest.mark.parametrize("train,match", [
    ({"gradient_checkpointing": True, "gradient_checkpointing_blocks": "ffn"},
     r"^test: train.gradient_checkpointing_blocks: must be one of layer, attention, mlp, got 'ffn'$"),
    ({"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"every_n_layers": 0}},
     r"^test: train.gradient_checkpointing_kwargs.every_n_layers: must be a positive integer"),
    ({"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": "maybe"}},
     r"^test: train.gradient_checkpointing_kwargs.use_reentrant: expected true or false, got 'maybe'$"),
    ({"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"offload": True}},
     r"^test: unknown key 'train.gradient_checkpointing_kwargs.offload'.* Allowed keys in "
     r"'train.gradient_checkpointing_kwargs': use_reentrant, every_n_layers"),
    ({"gradient_checkpointing": True, "gradient_checkpointing_kwargs": [1]},
     r"^test: train.gradient_checkpointing_kwargs: expected a mapping with keys use_reentrant"),
    ({"gradient_checkpointing": False, "gradient_checkpointing_blocks": "mlp"},
     r"^test: train.gradient_checkpointing: is false but gradient_checkpointing_blocks: 'mlp' asks for a "
     r"checkpointing granularity"),
    ({"gradient_checkpointing_kwargs": {"use_reentrant": True}},
     r"^test: train.gradient_checkpointing: is false but gradient_checkpointing_kwargs.use_reentrant: True"),
])
def test_bad_granularity_values_are_one_line_naming_the_key(train, match):
    with pytest.raises(ConfigError, match=match) as e:
        from_container({"train": train}, source="test")
    assert "\n" not in str(e.value)


def test_defaults_are_todays_checkpointing():
    t = TrainConfig()
    assert (t.gradient_checkpointing_kwargs.use_reentrant, t.gradient_checkpointing_kwargs.every_n_layers,
            t.gradient_checkpointing_blocks) == (False, 1, "layer")
    assert checkpointing.hf_kwargs(t) == {"use_reentrant": False}
    from onegpu.training.backends.hf_trainer import training_arguments
    on = from_container({"train": {"gradient_checkpointing": True}}).train
    args = training_arguments(from_container({"train": {"gradient_checkpointing": True}}), "/tmp/x")
    assert (args.activation_checkpointing, args.activation_checkpointing_kwargs) == (True, {"use_reentrant": False})
    assert on.gradient_checkpointing_blocks == "layer"
    sub = from_container({"train": {"gradient_checkpointing": True, "gradient_checkpointing_blocks": "mlp"}})
    args = training_arguments(sub, "/tmp/x")
    assert args.activation_checkpointing is False  # onegpu wraps the sub-blocks itself


def test_the_granularity_is_out_of_the_equivalence_key():
    from onegpu.equivalence.key import equivalence_key, run_config_hash
    base = from_container({"train": {"gradient_checkpointing": False}})
    keys, hashes = set(), set()
    for setting in SETTINGS:
        cfg = from_container({"train": {"gradient_checkpointing": True, "gradient_checkpointing_blocks": setting[1],
                                        "gradient_checkpointing_kwargs": {"every_n_layers": setting[0],
                                                                          "use_reentrant": setting[2]}}})
        keys.add(equivalence_key(cfg, resolve(cfg)))
        hashes.add(run_config_hash(cfg))
    assert keys == {equivalence_key(base, resolve(base))}
    assert len(hashes) == len(SETTINGS)  # a checkpoint resumes only its own configuration


def test_estimate_reports_the_configured_granularity():
    """``onegpu estimate``'s "with checkpointing" column comes from checkpointing.enable with the params'
    granularity (as the stage passes it): attention-only keeps more than whole layers, less than none."""
    from onegpu.training.memory import autobatch
    from onegpu.training.objectives import collator_for, model_inputs
    rows = model_inputs(dataset(24), "sequence-classification")["train"].add_column(
        "length", dataset(24)["train"]["length"])
    collator = collator_for("sequence-classification", tokenizer())
    col = {}
    for setting in [(1, "layer", False), (1, "attention", False)]:
        t = train_cfg(*setting)
        est = autobatch.estimate(bert4(), rows, collator, classification_loss, [4], "adamw_torch", True,
                                 lambda m, t=t: checkpointing.enable(m, t))
        col[setting[1]] = est["rows"][0]
    full, attn = col["layer"], col["attention"]
    assert full["activations"] == attn["activations"]  # without checkpointing: the same model
    assert full["activations_checkpointed"] < attn["activations_checkpointed"] < attn["activations"], col
    assert attn["total"] - full["total"] == attn["activations_checkpointed"] - full["activations_checkpointed"]


class _NoLayers:
    """A model that says it supports checkpointing but has neither BERT layers nor GPT-2 blocks."""
    supports_gradient_checkpointing = True

    def modules(self):
        return iter(())


def test_check_runs_both_checks_of_a_built_model_in_one_function():
    """Issue 31: whether the model supports activation checkpointing at all and whether it has the layers
    the configured granularity needs, both in checkpointing.check (build_model calls it once)."""
    with pytest.raises(ModelError, match="gradient_checkpointing_blocks: 'mlp' needs a BERT-style encoder"):
        checkpointing.check(_NoLayers(), train_cfg(blocks="mlp"))
    checkpointing.check(_NoLayers(), train_cfg(blocks="layer"))  # transformers' own: no layers to find
    checkpointing.check(tiny_bert(), train_cfg(blocks="attention"))
    unsupported = _NoLayers()
    unsupported.supports_gradient_checkpointing = False
    with pytest.raises(ModelError, match="^train.gradient_checkpointing: _NoLayers does not support activation "
                                         "checkpointing; set it to false$"):
        checkpointing.check(unsupported, train_cfg(blocks="layer"))
    checkpointing.check(unsupported, train_cfg(on=False))  # off: nothing to check
