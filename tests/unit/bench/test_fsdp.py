"""bench/fsdp.py: on a CPU, both arms train a 1-layer SmolLM2-shaped model through onegpu's accelerate backend, the
sharded one under train.fsdp in a gloo process group of one rank; the same per-step losses and grad norms, the
gathered weights, the measured state bytes equal to per_rank_bytes at N = 1; a sharded arm that fails is reported
with the unsharded arm's figures."""
from __future__ import annotations

import argparse

import pytest

torch = pytest.importorskip("torch")

from bench import fsdp, gpu_models  # noqa: E402


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """``(args, runs, error)`` of :func:`bench.fsdp.run` on a 1-layer hidden-32 model, 2 steps of 2 x 2."""
    from onegpu.training.memory import host_allocator
    own = host_allocator.apply  # not the process-wide mallopt (as tests/unit/bench/test_memory_knobs.py)
    host_allocator.apply = lambda setting, device: setting
    try:
        model = gpu_models.write_smollm2(tmp_path_factory.mktemp("fsdp") / "m", layers=1, hidden=32, heads=2,
                                         kv_heads=1, intermediate=48)
        args = argparse.Namespace(model=str(model), max_length=48, rows=8, micro=2, accum=2, steps=2, lr=1e-3,
                                  lora=0, bf16=False, keep_gathered=False)
        runs, error, _ = fsdp.run(args)
    finally:
        host_allocator.apply = own
    import torch.distributed as dist
    assert not dist.is_initialized()  # the one-rank process group is destroyed
    return args, runs, error


def test_both_arms_train_the_same_steps_and_the_sharded_one_gathers_the_same_weights(trained):
    args, runs, error = trained
    assert error is None and list(runs) == ["unsharded", "sharded"]
    u, s = runs["unsharded"]["rows"], runs["sharded"]["rows"]
    assert [r["step"] for r in u] == [r["step"] for r in s] == [1, 2]
    assert all(r["loss"] == pytest.approx(10.8, abs=0.5) for r in u)  # ln(49152) = 10.8: random init
    for a, b in zip(u, s):  # one rank: the reduce-scatter is a copy; float32 floor at most
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-6) and a["grad_norm"] > 0
    assert runs["sharded"]["plain"]  # gather: a plain model, no DTensor left
    assert set(runs["sharded"]["weights"]) == set(runs["unsharded"]["weights"])
    assert fsdp.weight_distance(runs["sharded"]["weights"], runs["unsharded"]["weights"]) <= 1e-6


def test_the_sharded_arms_state_bytes_are_the_prediction_at_one_rank_and_halve_at_two(trained):
    _, runs, _ = trained
    pred = runs["unsharded"]["predicted"]
    assert sorted(pred) == [1, 2, 4, 8]
    weights = 49152 * 32 + (32 * 32 + 2 * 32 * 16 + 32 * 32 + 3 * 32 * 48 + 2 * 32) + 32
    got = {k: runs["sharded"]["memory"][k] for k in fsdp.STATES}
    assert got == {"mem_params_bytes": 4 * weights, "mem_grads_bytes": 4 * weights, "mem_optimizer_bytes": 8 * weights}
    assert got == {k: pred[1][k] for k in fsdp.STATES} == {k: runs["unsharded"]["memory"][k] for k in fsdp.STATES}
    assert pred[2]["mem_params_bytes"] < 0.51 * pred[1]["mem_params_bytes"]
    assert pred[2]["mem_grads_bytes"] == pred[1]["mem_grads_bytes"]  # accumulation 2: whole gradients


def test_the_report_has_a_row_per_step_the_memory_rows_and_passing_checks(trained):
    args, runs, error = trained
    lines = fsdp.report_lines(args, runs, "m", error, [0.5])
    text = "\n".join(lines)
    assert [line.split("|")[1].strip() for line in text.splitlines() if line.startswith("| ") and
            line.split("|")[1].strip().isdigit()] == ["1", "2"]
    for label in ("unsharded (measured)", "sharded (measured)", "sharded, N = 1 rank (predicted)",
                  "sharded, N = 8 ranks (predicted)"):
        assert f"| {label}" in text, label
    assert "process group of world size 1 (gloo)" in text and "not the arithmetic of N ranks" in text
    assert "resident set" in text  # what a CPU's peak is
    assert all(ok for ok, _ in fsdp.checks(runs, error)), fsdp.checks(runs, error)
    assert len(fsdp.checks(runs, error)) == 7
    assert fsdp.payload(runs, error)["runs"]["sharded"].keys() >= {"rows", "memory"}
    assert "weights" not in fsdp.payload(runs, error)["runs"]["sharded"]


def test_a_failed_sharded_arm_reports_the_unsharded_figures_and_its_error(trained):
    args, runs, _ = trained
    alone = {"unsharded": runs["unsharded"]}
    error = "RuntimeError: NCCL error"
    text = "\n".join(fsdp.report_lines(args, alone, "m", error, [0.5]))
    assert "Sharded arm failed: RuntimeError: NCCL error" in text
    assert "| unsharded (measured)" in text and "| sharded (measured)" not in text
    assert fsdp.checks(alone, error)[0] == (False, "the sharded arm ran: RuntimeError: NCCL error")


def test_a_step_or_weight_beyond_the_bar_fails_its_check(trained):
    _, runs, _ = trained
    bad = {"unsharded": runs["unsharded"], "sharded": {**runs["sharded"], "rows": [
        {**r, "grad_norm": r["grad_norm"] * (1 + 1e-3)} for r in runs["sharded"]["rows"]]}}
    result = {text.split(":")[0]: ok for ok, text in fsdp.checks(bad, None)}
    assert result["grad_norm"] is False and result["loss"] is True
    w = dict(runs["sharded"]["weights"])
    name = next(iter(w))
    w[name] = w[name] * 1.01
    assert fsdp.weight_distance(w, runs["unsharded"]["weights"]) == pytest.approx(0.01, rel=1e-3)
    del w[name]
    assert fsdp.weight_distance(w, runs["unsharded"]["weights"]) == float("inf")
