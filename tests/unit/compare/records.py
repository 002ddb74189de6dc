"""Synthetic training-run records for the compare tests (MLflow's string params and tags). Not a test module."""
from __future__ import annotations

import math

from onegpu.compare import RunRecord

KEY = "0123456789abcdef"
STEPS = 8


def _loss(step: int) -> float:
    return 1.6 * math.exp(-0.15 * step) + 0.2


def record(name: str, micro: int, accum: int, *, ckpt: bool = False, loss=None, dropout: float = 0.0,
           batchnorm: int = 0, bf16: bool = False, device: str = "cpu", backend: str = "trainer",
           start: int = 0, key: str = KEY, mem: float = 1e9, sps: float = 100.0,
           evals: dict | None = None) -> RunRecord:
    loss = loss or [(s, _loss(s)) for s in range(1, STEPS + 1)]
    return RunRecord(
        run_id=f"id-{name}", name=name,
        params={"resolved.per_device_train_batch_size": str(micro),
                "resolved.gradient_accumulation_steps": str(accum),
                "resolved.effective_batch_size": str(micro * accum),
                "train.per_device_train_batch_size": str(micro),
                "train.gradient_accumulation_steps": str(accum),
                "train.gradient_checkpointing": str(ckpt), "train.bf16": str(bf16), "train.fp16": "False",
                "train.backend": backend, "model.dropout": "None"},
        tags={"equivalence_key": key, "device": device, "model.dropout_max": str(dropout),
              "model.batchnorm_layers": str(batchnorm), "stage": "train"},
        metrics={"train_mem_peak_bytes": mem, "train_samples_per_second": sps,
                 **(evals or {"test_loss": 0.5, "test_accuracy": 0.9})},
        series={"loss": loss, "grad_norm": [(s, 2.0 / s) for s, _ in loss],
                "step_time_s": [(s, 64 / sps) for s, _ in loss],
                "mem_peak_bytes": [(s, mem) for s, _ in loss]},
        start_time=start, status="FINISHED")


def drifted(at: int, rel: float = 1e-2) -> list[tuple[int, float]]:
    """The reference loss, off by ``rel`` (relative) from step ``at`` on, and by 1e-7 before."""
    return [(s, _loss(s) * (1 + (rel if s >= at else 1e-7))) for s in range(1, STEPS + 1)]


def windowed(name, micro, accum, start_s, end_s, machine="m1", **kw) -> RunRecord:
    r = record(name, micro, accum, **kw)
    r.tags.update({"onegpu.train_start_ms": str(start_s * 1000), "onegpu.train_end_ms": str(end_s * 1000),
                   "onegpu.machine": machine})
    return r


def _with(r: RunRecord, **params) -> RunRecord:
    r.params.update({k: str(v) for k, v in params.items()})
    return r
