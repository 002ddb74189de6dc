"""bench/memory_knobs.py: the arms train through onegpu on a SmolLM2-shaped model and their optimizer states are
what AdamW keeps; offloading runs only with CUDA; each check fails where its bar is crossed."""
from __future__ import annotations

import argparse

import pytest

pytest.importorskip("torch")

from bench import gpu_models, memory_knobs  # noqa: E402


def _run(loss: list[float], states: int, peak: int) -> dict:
    rows = [{"step": i + 1, "loss": x, "step_time_s": 0.1, "mem_peak_bytes": peak} for i, x in enumerate(loss)]
    return {"rows": rows,
            "memory": {"mem_optimizer_bytes": states, "mem_activation_bytes": 1}, "device": "cuda:0"}


def test_offloading_runs_only_with_cuda_and_adamw_always():
    assert memory_knobs.arms_here(cuda=False) == ["adamw", "8bit", "4bit"]
    assert memory_knobs.arms_here(cuda=True) == ["adamw", "offload", "8bit", "4bit"]
    assert memory_knobs.arms_here(cuda=True, wanted=("4bit",)) == ["adamw", "4bit"]


def test_each_check_fails_where_its_bar_is_crossed():
    ref = _run([2.0, 1.5, 1.2], 800, 1000)
    good = {"adamw": ref, "offload": _run([2.0, 1.5, 1.2], 800, 600), "8bit": _run([2.0, 1.5, 1.3], 250, 900),
            "4bit": _run([2.0, 1.6, 1.3], 130, 880)}
    assert [ok for ok, _ in memory_knobs.checks(good)] == [True] * 5
    bad = {"adamw": ref, "offload": _run([2.0, 1.5, 1.21], 800, 1000), "8bit": _run([2.0, 1.5, 1.3], 300, 900),
           "4bit": _run([2.0, float("nan"), 1.3], 170, 880)}
    result = dict((text.split(":")[0], ok) for ok, text in memory_knobs.checks(bad))
    assert result == {"every loss is finite": False, "8bit": False, "4bit": False, "offload": False}
    assert len(memory_knobs.checks(bad)) == 5  # both offload checks: losses (1.21 vs 1.2) and peak (not lower)
    assert memory_knobs.distance(bad["offload"], ref) == pytest.approx(0.01 / 1.2)


def test_the_adamw_arm_trains_through_onegpu_with_eight_bytes_of_state_per_weight(tmp_path, monkeypatch):
    from onegpu.training.memory import host_allocator
    # not bench.environment.setup() (its SIGTERM handler would outlive the test) nor the process-wide mallopt
    monkeypatch.setattr(host_allocator, "apply", lambda setting, device: setting)
    model = gpu_models.write_smollm2(tmp_path / "m", layers=1, hidden=32, heads=2, kv_heads=1, intermediate=48)
    args = argparse.Namespace(model=str(model), max_length=48, rows=8, micro=2, accum=1, steps=2, lr=1e-3, lora=0,
                              bf16=False)
    dsd, tok, path = memory_knobs._data(args)
    run = memory_knobs.train_arm(args, "adamw", dsd, tok)
    assert [r["step"] for r in run["rows"]] == [1, 2] and run["device"] == "cpu"
    assert all(r["loss"] == pytest.approx(10.8, abs=0.5) for r in run["rows"])  # ln(49152) = 10.8: random init
    weights = 49152 * 32 + (32 * 32 + 2 * 32 * 16 + 32 * 32 + 3 * 32 * 48 + 2 * 32) + 32
    states = run["memory"]["mem_optimizer_bytes"]
    assert 8 * weights <= states <= 8 * weights + 64 * 12  # exp_avg and exp_avg_sq in fp32, one step count each
    lines = memory_knobs.report_lines(args, {"adamw": run}, "m", [0.5])
    assert any(line.startswith("| adamw") for line in "\n".join(lines).splitlines())
    assert "offload: not run (CUDA only" in "\n".join(lines) and lines[-1] == "- passed: every loss is finite"
