"""The knobs of the same training other than the fused head, on the causal LM of SmolLM2-135M-Instruct's
shape built from config (tests/unit/equivalence/float64.py's ``lm_run``), in float64 against the fused head
at 8 x 1 (the list of knobs and how each is proven: test_same_training.py)."""
from __future__ import annotations

import functools

import pytest

torch = pytest.importorskip("torch")

from tests.unit.equivalence import float64 as f64  # noqa: E402

pytestmark = pytest.mark.slow  # float64 on a model of SmolLM2's width and vocabulary: make test-quick leaves it out


@functools.cache
def _ref(**kw) -> f64.Run:
    """A reference run, kept for the file's tests: ``f64.lm_run(**kw)``. Every knob's reference is the fused
    head at 8 x 1 (it projects only the targets: several times faster), which equals the whole logits
    (test_same_training.py::test_the_fused_head_is_the_whole_logits_in_float64)."""
    return f64.lm_run(**kw)


@pytest.mark.parametrize("micro,accum", [(4, 2), (1, 8)])
def test_splits_of_the_effective_batch_are_the_same_training(micro, accum):
    f64.assert_same(f64.lm_run(micro=micro, accum=accum), _ref())


def test_padding_free_is_the_same_training_as_padded():
    f64.assert_same(f64.lm_run(micro=2, accum=4, padding_free=True), _ref())


def test_both_backends_are_the_same_training():
    f64.assert_same(f64.lm_run(micro=2, accum=4, backend="accelerate", padding_free=True), _ref())


@pytest.mark.parametrize("ckpt", [{"use_reentrant": False}, {"use_reentrant": True, "every_n_layers": 2}])
def test_checkpointing_is_the_same_training(ckpt):
    f64.assert_same(f64.lm_run(micro=2, accum=4, checkpointing=tuple(ckpt.items())), _ref())


def test_the_attention_kernel_eager_is_sdpa_in_float64():
    """Eager attention against SDPA, with eager's softmax in float64 (transformers' takes it in float32
    whatever the model's dtype, 2e-7 off in float64: float64.py's ``float64_throughout``)."""
    f64.assert_same(f64.lm_run(attn="eager"), _ref())
