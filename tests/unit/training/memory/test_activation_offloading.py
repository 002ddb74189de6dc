"""train.activation_offloading: off is no context; on, both backends run every micro-batch's forward and
backward (every piece after an out-of-memory re-split too) inside the offloading context, built once per
training. That it is the same training on CUDA is tests/gpu/test_cuda.py's (a CPU has nothing to offload:
the config refuses it there)."""
from __future__ import annotations

import contextlib
import importlib

import pytest

torch = pytest.importorskip("torch")

from onegpu.training.memory import activation_offloading  # noqa: E402
from tests.unit.training.objectives import test_batches as tb  # noqa: E402


def test_off_is_a_no_op_context():
    assert isinstance(activation_offloading.context(torch.nn.Linear(2, 2), False), contextlib.nullcontext)


class _Counting:
    """A stand-in for TRL's offloading context: counts entries and whether a forward ran inside one."""

    def __init__(self):
        self.entered = self.built = 0
        self.inside = False

    def __enter__(self):
        self.entered += 1
        self.inside = True

    def __exit__(self, *exc):
        self.inside = False


@pytest.mark.parametrize("backend", ["accelerate", "trainer"])
def test_both_backends_run_each_micro_batch_in_the_offloading_context(backend, monkeypatch):
    from onegpu.training.backends import base
    ctx, forwards = _Counting(), []

    def context(model, enabled):
        ctx.built += 1
        return ctx if enabled else contextlib.nullcontext()
    monkeypatch.setattr(activation_offloading, "context", context)
    cfg = tb.config(backend, 2, 4, activation_offloading=True)
    model = tb.tiny_llama()
    model.register_forward_pre_hook(lambda m, args: forwards.append(ctx.inside))
    _, steps = importlib.import_module(base.REGISTRY[backend]).train(
        base.TrainRequest(model, tb.tokenizer(), tb.dataset(), cfg, sink=lambda m, s: None))
    assert ctx.built == 1 and ctx.entered == 2 * 4  # 2 steps of 4 micro-batches
    # the activation probe's forward is outside (it measures, trains nothing); every training forward inside
    assert forwards.count(True) == 8 and forwards.count(False) == 1
    tb.assert_same_steps(steps.rows, tb.train(backend, 2, 4))
