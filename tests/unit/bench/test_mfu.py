"""bench/mfu.py on a tiny GPT-2 on the CPU: the FLOPs per token are nanoGPT's 6N + 12 L d T, the MFU is
tokens/s x that over the peak, both arms train the same steps, and the report names the device."""
from __future__ import annotations

import json
import re

from bench import mfu

TINY = ["--layers", "2", "--hidden", "32", "--heads", "2", "--vocab", "128", "--seq", "16", "--batch", "2",
        "--steps", "2", "--warmup", "0", "--device", "cpu", "--fp32"]


def test_flops_per_token_is_6n_plus_attention():
    args = mfu.parse(TINY)
    model = mfu.build(args, "cpu")
    from onegpu.measure.flops import flops_per_token
    n = sum(p.numel() for p in model.parameters()) - model.transformer.wpe.weight.numel()  # wte = tied lm_head
    assert flops_per_token(model, args.seq) == 6 * n + 12 * args.layers * args.hidden * args.seq


def test_run_writes_tables_with_mfu_and_equal_losses(tmp_path, monkeypatch):
    monkeypatch.setenv("ONEGPU_CACHE_DIR", str(tmp_path / "cache"))
    assert mfu.main([*TINY, "--arms", "eager,eager", "--out", str(tmp_path), "--tag", "t"]) == 0
    data = json.loads((tmp_path / "mfu-t.json").read_text())
    a, b = data["arms"]
    assert len(a["losses"]) == 3 and a["losses"] == b["losses"]  # same seed, same batches: the same training
    tps = a["tokens_per_step"] / a["median_step_s"]
    assert abs(a["model_flops_per_second"] - tps * a["flops_per_token"]) <= 1e-6 * a["model_flops_per_second"]
    assert abs(a["mfu"] - a["model_flops_per_second"] / data["peak"]["peak"]) < 1e-12
    md = (tmp_path / "mfu-t.md").read_text()
    assert "Device: " in md and "torch " in md and re.search(r"^\| eager +\|", md, re.M)
