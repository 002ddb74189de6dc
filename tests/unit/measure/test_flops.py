"""Model FLOPs, device peaks, MFU and a finished training's speed (onegpu.measure.flops)."""
from __future__ import annotations

import pytest
import torch

from onegpu.measure import flops, memory


def test_flops_of_the_default_classifier_match_a_hand_count(minilm):
    """MiniLM-L6 (BERT, 6 layers, d=384, FFN 1536) + pooler + a 5-class head, 64 tokens per example.

    Per layer: Q, K, V, O     4 x (384*384 + 384)           =   591,360
               FFN in + out   384*1536 + 1536 + 1536*384 + 384 = 1,181,568
               2 LayerNorms   2 x (384 + 384)                =     1,536
               layer total                                   = 1,774,464
    6 layers 10,646,784 + embedding LayerNorm 768 = N_tok 10,647,552 (token/position/type tables left out:
    lookups, no matmul).
    Once per sequence: pooler 384*384 + 384 = 147,840; head 384*5 + 5 = 1,925; N_seq = 149,765.
    Per token at T = 64: 6 * 10,647,552 + 12 * 6 * 384 * 64 + 6 * 149,765 / 64
                       = 63,885,312 + 1,769,472 + 14,040.46875 = 65,668,824.46875
    """
    model, _ = minilm
    assert flops.matmul_parameters(model) == (10_647_552, 149_765)
    assert flops.flops_per_token(model, 64) == pytest.approx(65_668_824.46875, rel=1e-12)


def test_flops_of_a_causal_lm_count_the_tied_unembedding():
    """GPT-2 as built from params.yaml's defaults (4 layers, d=128, vocab 4096, context 64), the output
    projection tied to the token embedding. Issue 9 case 5: 5,153,280 was logged, the matmuls are 8,299,008.

    Per layer: c_attn 128*384 + 384 = 49,536; attn c_proj 128*128 + 128 = 16,512;
               c_fc 128*512 + 512 = 66,048; mlp c_proj 512*128 + 128 = 65,664; ln_1 + ln_2 4*128 = 512
               layer total 198,272; 4 layers 793,088; + ln_f 256 = 793,344
    Unembedding (lm_head, tied to wte, still a 128 x 4096 matmul per token): 524,288
    N_tok = 793,344 + 524,288 = 1,317,632 (wte/wpe lookups left out), N_seq = 0.
    Per token at T = 64: 6 * 1,317,632 + 12 * 4 * 128 * 64 = 7,905,792 + 393,216 = 8,299,008
    """
    from transformers import GPT2Config, GPT2LMHeadModel
    model = GPT2LMHeadModel(GPT2Config(vocab_size=4096, n_positions=64, n_embd=128, n_layer=4, n_head=4,
                                       bos_token_id=0, eos_token_id=0))
    assert model.lm_head.weight is model.transformer.wte.weight  # tied
    assert flops.matmul_parameters(model) == (1_317_632, 0)
    assert flops.flops_per_token(model, 64) == 8_299_008


def test_attention_flops_use_each_examples_own_length():
    """Two examples of 10 and 30 non-padding tokens (padded to 30): attention costs 12 L d (10^2 + 30^2),
    not 12 L d x 40 x (mean 20) and not at the padded 30 for both."""
    from transformers import GPT2Config, GPT2LMHeadModel
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                       bos_token_id=0, eos_token_id=0))
    n_tok, _ = flops.matmul_parameters(model)
    assert flops.train_flops(model, 2, 40, 10**2 + 30**2) == 6 * n_tok * 40 + 12 * 2 * 32 * 1000


def test_flops_under_lora_count_frozen_weights_without_their_weight_gradient():
    """The tiny 2-layer BERT classifier of tests/unit/tiny.py (d=32, FFN 64, 3 labels) with LoRA r=4 on query
    and value, hand-counted (2 FLOPs per weight and use forward, +2 input gradient, +2 weight gradient).

    Per token, in registration order (embedding tables are lookups; the first trainable weight is
    layer 0's query.lora_A):
      before it, forward only:     embedding LayerNorm 64 + layer-0 query.base_layer 32*32+32 = 1,120
      layer-0 query.lora_A 4*32:   forward + weight gradient (its input needs no gradient)  =   128
      frozen after it, fwd + input grad: layer 0: key 1,056, value 1,056, attention out 1,056 + LN 64,
          FFN 32*64+64 + 64*32+32 = 4,192, LN 64 = 7,488; layer 1: 4 x 1,056 + 64 + 4,192 + 64 = 8,544
          -> 16,032
      adapters after it, all three parts: q.lora_B 128, v.lora_A + v.lora_B 256, layer 1 4 x 128 = 512
          -> 896
      N_tok = 1,120 + 128 + 16,032 + 896 = 18,176 (17,152 without the adapters + 1,024)
      input grad = 16,032 + 896 = 16,928; weight grad = 128 + 896 = 1,024
    Per sequence: pooler 1,056 frozen (fwd + input grad), peft's trainable head copy 3*32+3 = 99 (all
    three); the frozen original head never runs and is not counted: N_seq = 1,155.
    Two examples of 10 and 30 tokens: 2 (18,176 + 16,928 + 1,024) * 40 + 12 * 2 * 32 * (10^2 + 30^2)
    + 2 (1,155 + 1,155 + 99) * 2 = 2,890,240 + 768,000 + 9,636 = 3,667,876. The count before (6 x every
    parameter of the PeftModel, both head copies, all per token) gave 5,431,200: MFU overstated 1.48x.
    Without LoRA the same model is 6 N: 6 * 17,152 * 40 + 768,000 + 6 * 1,155 * 2.
    """
    pytest.importorskip("peft")
    from onegpu.config import LoraConfig
    from onegpu.models import lora
    from tests.unit.tiny import tiny_bert
    full = tiny_bert()
    assert flops.matmul_parameters(full) == (17_152, 1_155)
    assert flops.train_flops(full, 2, 40, 1000) == 6 * 17_152 * 40 + 768_000 + 6 * 1_155 * 2
    model = lora.apply(tiny_bert(), LoraConfig(r=4, alpha=8, target_modules=["query", "value"]),
                       "sequence-classification")
    assert flops.matmul_counts(model) == {"tok": 18_176, "tok_input_grad": 16_928, "tok_weight_grad": 1_024,
                                          "seq": 1_155, "seq_input_grad": 1_155, "seq_weight_grad": 99}
    assert flops.train_flops(model, 2, 40, 1000) == 3_667_876
    assert flops.matmul_parameters(model) == (18_176, 1_155)


@pytest.mark.parametrize("mixed, dtype", [("bf16", "bf16"), ("fp16", "fp16"), ("no", "fp32")])
def test_matmul_dtype_of_the_mixed_precision(mixed, dtype):
    assert flops.matmul_dtype(mixed) == dtype


def test_device_peak_uses_the_datasheet_for_known_gpus_and_measures_a_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("ONEGPU_CACHE_DIR", str(tmp_path))
    assert flops.device_peak("NVIDIA H200", "bf16", "cuda:0") == (989e12, "datasheet")
    peak, source = flops.device_peak("cpu", "fp32", "cpu")
    assert source == "measured" and 1e8 < peak < 1e14
    entry, = flops.read_cache().values()
    assert entry["peak_flops"] == peak and entry["measurements"] == 1 and entry["measured_at"].endswith("Z")
    assert flops.cache_file() == tmp_path / "peak_flops.json"


def test_tests_never_touch_the_users_cache():
    from pathlib import Path
    assert Path.home() / ".cache" not in flops.cache_file().parents


def _busy_loops():
    """A busy Python loop on every core this process may use; returns the processes."""
    import subprocess
    import sys
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(memory.cpu_count())]


def _train_flops_per_second(steps: int = 4) -> float:
    """Train a small GPT-2 (AdamW, micro-batch 8 x 64 tokens) for a few steps; model FLOP/s achieved."""
    import time

    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=1024, n_positions=64, n_embd=128, n_layer=2, n_head=4,
                                       bos_token_id=0, eos_token_id=0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 1024, (8, 64))
    model(input_ids=ids, labels=ids).loss.backward()  # warm-up
    opt.zero_grad()
    t0 = time.perf_counter()
    for _ in range(steps):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    dt = time.perf_counter() - t0
    return flops.train_flops(model, 8 * steps, 8 * 64 * steps, 8 * 64 * 64 * steps) / dt


def test_a_peak_measured_under_full_load_keeps_mfu_at_most_1(tmp_path, monkeypatch):
    """Issue 9 case 4: a CPU peak measured while every core runs a busy loop must not be low (it read
    29 instead of 196 GFLOP/s and inflated every later MFU 6.7x); training afterwards has MFU in (0, 1]."""
    monkeypatch.setenv("ONEGPU_CACHE_DIR", str(tmp_path))
    busy = _busy_loops()
    try:
        import time
        time.sleep(0.3)  # let the loops take the cores
        loaded = flops.measured_peak("cpu", "fp32", refresh=True)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    quiet = flops._measure("cpu", "fp32", torch.get_num_threads(), 0.4)
    assert loaded > 0.6 * quiet, (loaded, quiet)  # wall-clock timing read a half or less under this load
    achieved = _train_flops_per_second()
    m = flops.mfu(achieved, "cpu", "fp32", "cpu")
    assert m["source"] == "measured" and 0 < m["mfu"] <= 1, (achieved, m)


def test_a_stale_low_peak_is_measured_again_and_the_cache_keeps_the_maximum(tmp_path, monkeypatch):
    import json
    monkeypatch.setenv("ONEGPU_CACHE_DIR", str(tmp_path))
    key = flops._cache_key("cpu", "fp32", torch.get_num_threads())
    stale = {"peak_flops": 1e6, "measured_at": "2026-01-01T00:00:00Z", "measurements": 1}
    (tmp_path / "peak_flops.json").write_text(json.dumps({key: stale}))
    m = flops.mfu(5e8, "cpu", "fp32", "cpu")  # 500x the cached "peak"
    assert m["remeasured"] and m["peak"] > 1e8 and 0 < m["mfu"] <= 1
    entry = flops.read_cache()[key]
    assert entry["peak_flops"] == m["peak"] and entry["measurements"] == 2
    assert entry["measured_at"] != stale["measured_at"] and "threads" in entry["machine"]
    # A later, lower measurement never replaces the maximum.
    monkeypatch.setattr(flops, "_measure", lambda *a: 1e6)
    assert flops.measured_peak("cpu", "fp32", refresh=True) == m["peak"]
    assert flops.read_cache()[key]["measurements"] == 3


def test_an_mfu_still_above_1_is_not_reported(tmp_path, monkeypatch):
    monkeypatch.setenv("ONEGPU_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(flops, "_measure", lambda *a: 1e9)
    m = flops.mfu(5e9, "cpu", "fp32", "cpu")
    assert m["mfu"] is None and m["remeasured"]
    assert "above the measured peak" in m["unknown_reason"] and "no MFU" in m["unknown_reason"]
    # A datasheet peak is not re-measured.
    m = flops.mfu(2e15, "NVIDIA H200", "bf16", "cuda:0")
    assert m["mfu"] is None and not m["remeasured"] and m["source"] == "datasheet"


def test_speed_metrics_of_a_training_divide_its_model_flops_by_its_time_and_the_device_peak(minilm):
    model, _ = minilm
    summary = {"train_samples": 64, "train_tokens": 64 * 50, "train_runtime": 8.0}
    metrics, params, tags = flops.speed_metrics(model, summary, 2, "bf16", "cuda:0", "NVIDIA H200", 64 * 50 * 50)
    total = flops.train_flops(model, 64, 64 * 50, 64 * 50 * 50)
    assert metrics["train_flops_per_second"] == pytest.approx(total / 8.0)
    assert metrics["model_flops_per_token"] == pytest.approx(total / (64 * 50))
    # two processes, each on its own H200: each device's share against its bf16 datasheet peak
    assert metrics["train_mfu"] == pytest.approx(total / 8.0 / 2 / 989e12)
    assert params == {"device_peak_flops.source": "datasheet"} and tags == {}
    empty = {"train_samples": 0, "train_runtime": 0.0}
    assert flops.speed_metrics(model, empty, 1, "no", "cpu", "cpu") == ({}, {}, {})


def test_speed_metrics_without_a_trustworthy_peak_leave_mfu_out_and_say_why(minilm):
    model, _ = minilm
    summary = {"train_samples": 8, "train_tokens": 400, "train_runtime": 1e-12}  # far above any peak
    metrics, _, tags = flops.speed_metrics(model, summary, 1, "bf16", "cuda:0", "NVIDIA H200")
    assert "train_mfu" not in metrics and "no MFU is given" in tags["train_mfu.unknown_reason"]


def test_flops_of_a_llama_count_grouped_query_attention_swiglu_and_the_tied_unembedding():
    """A Llama of SmolLM2's shape, shrunk: hidden 48, 2 layers, 4 query heads of 16 (query width 64, not the
    hidden size), 2 key/value heads, SwiGLU MLP of 80, tied embeddings, vocab 256, no biases.

    Per layer: q_proj 48*64 = 3,072; k_proj, v_proj 48*(2*16) = 1,536 each (grouped-query: 2 kv heads);
               o_proj 64*48 = 3,072; gate_proj, up_proj, down_proj 3 * 48*80 = 11,520 (SwiGLU: 3 matrices);
               input/post-attention RMSNorm 2*48 = 96; layer total 20,832; 2 layers 41,664; + final norm 48
    Unembedding (lm_head, tied to embed_tokens, a 48 x 256 matmul per token): 12,288
    N_tok = 41,664 + 48 + 12,288 = 54,000; attention 12 * 2 layers * 64 (4 heads x 16) per token and context.
    Per token at T = 32: 6 * 54,000 + 12 * 2 * 64 * 32 = 324,000 + 49,152 = 373,152
    """
    from transformers import LlamaConfig, LlamaForCausalLM
    model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                         tie_word_embeddings=True, max_position_embeddings=64))
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied
    assert flops.matmul_parameters(model) == (54_000, 0)
    assert flops.flops_per_token(model, 32) == 373_152

