"""The tolerance of each training precision (onegpu.compare.tolerances) and what it lets pass."""
from __future__ import annotations

from onegpu import compare as eq
from tests.tables import row
from tests.unit.compare.records import _with, drifted, record


def test_bf16_uses_the_looser_tolerance():
    loss = drifted(3, rel=3e-3)  # beyond fp32's tolerance, within bf16's
    fp32 = eq.compare_run(record("a", 4, 16, loss=loss), record("ref", 64, 1))
    assert fp32.precision == "fp32" and fp32.verdict == "diverged at step 3"
    bf16 = eq.compare_run(record("b", 4, 16, bf16=True, loss=loss), record("ref", 64, 1, bf16=True))
    assert bf16.precision == "bf16" and bf16.tolerance == eq.TOLERANCES["bf16"]
    assert bf16.verdict == "equivalent"
    assert eq.compare_run(record("c", 4, 16, bf16=True, loss=drifted(5, rel=5e-2)),
                          record("ref", 64, 1, bf16=True)).verdict == "diverged at step 5"


def test_eps_is_each_precisions_machine_epsilon_and_every_precision_has_its_tolerances_and_basis():
    import numpy as np
    import torch
    assert eq.EPS == {"fp32": float(np.finfo(np.float32).eps), "fp16": float(np.finfo(np.float16).eps),
                      "bf16": torch.finfo(torch.bfloat16).eps,
                      "tf32": float(np.finfo(np.float16).eps)}  # TF32 keeps fp16's 10-bit mantissa
    assert set(eq.TOLERANCE_BASIS) == set(eq.TOLERANCES) == set(eq.GRAD_NORM_TOLERANCES) == set(eq.EPS)
    # each tolerance is at least the precision's eps: rounding alone never reads as a divergence
    assert all(eq.TOLERANCES[p].rtol >= eq.EPS[p] and eq.GRAD_NORM_TOLERANCES[p].rtol >= eq.TOLERANCES[p].rtol
               for p in eq.EPS)
    from onegpu.compare import report
    md = report.markdown(eq.compare([record("ref", 64, 1), record("split", 4, 16, start=1)]), images=())
    assert row(md, "fp32")[:4] == ["fp32", "1.19e-07", "0.0001 / 1e-06", "0.001 / 1e-06"]
    assert "measured here" in md and "grad_norm" in md
    assert "max rel Δ grad_norm" in md


def test_tf32_on_a_gpu_uses_its_looser_tolerance_and_is_a_no_op_on_cpu():
    assert eq.TOLERANCES["fp32"].rtol < eq.TOLERANCES["tf32"].rtol < eq.TOLERANCES["bf16"].rtol
    loss = drifted(3, rel=1e-3)  # beyond fp32's tolerance, within tf32's
    gpu = "NVIDIA H200"
    c = eq.compare_run(_with(record("t", 4, 16, loss=loss, device=gpu), **{"train.tf32": True}),
                       record("ref", 64, 1, device=gpu))
    assert c.precision == "tf32" and c.tolerance == eq.TOLERANCES["tf32"] and c.verdict == "equivalent"
    assert any(cause.startswith("train.tf32 differs") for cause in c.causes)
    assert not any("mixed precision" in cause for cause in c.causes)
    cpu = eq.compare_run(_with(record("t", 4, 16, loss=loss), **{"train.tf32": True}), record("ref", 64, 1))
    assert cpu.precision == "fp32" and cpu.verdict == "diverged at step 3"
    assert eq.compare_run(_with(record("t", 4, 16, loss=drifted(4, rel=5e-3), device=gpu), **{"train.tf32": True}),
                          record("ref", 64, 1, device=gpu)).verdict == "diverged at step 4"


def test_a_sharded_pair_keeps_the_multi_step_tolerance_at_step_1():
    """FSDP2 reduce-scatters the gradients and sums their norm over shards in another order: measured once on
    the default classifier, step 1's grad_norm 1.7e-6 from plain data parallel's, beyond the 1e-6 floor of the
    splits; a sharded pair is held to the fp32 multi-step tolerance, as a GPU pair is."""
    from onegpu.compare.tolerances import FIRST_STEP_TOLERANCES, first_step_tolerance_for
    dp = record("dp", 8, 2)
    assert first_step_tolerance_for(record("dp2", 8, 2), dp) == FIRST_STEP_TOLERANCES["fp32"]
    sharded = _with(record("fsdp", 8, 2, loss=[(1, 1.0), (2, 0.9)]), **{"train.fsdp.enabled": True})
    assert first_step_tolerance_for(sharded, dp) is None and first_step_tolerance_for(dp, sharded) is None
    sharded.series["grad_norm"] = [(1, 2.0 * (1 + 1.7e-6)), (2, 1.0)]
    c = eq.compare_run(sharded, _with(record("dp", 8, 2, loss=[(1, 1.0), (2, 0.9)])))
    assert c.verdict == "equivalent", (c.verdict, c.notes)
