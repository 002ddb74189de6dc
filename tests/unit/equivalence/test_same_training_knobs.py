"""The knobs of the same training other than the fused head, on the causal LM of SmolLM2-135M-Instruct's shape
built from config (tests/unit/equivalence/float64.py's ``lm_run``; each also on its narrow twin), in float64
against the fused head at 8 x 1 (the list of knobs and how each is proven: test_same_training.py).

The rows are answers of 1..9 words (3 to 9 target tokens a row, ``float64.answer_rows``), so the
micro-batches of every split hold different numbers of targets: the exact loss (each micro-batch's sum over
the whole step's targets) and a mean of each micro-batch's own mean then differ, and the last test shows
the proof sees that difference."""
from __future__ import annotations

import functools

import pytest

torch = pytest.importorskip("torch")

from tests.unit.equivalence import float64 as f64  # noqa: E402

# Each proof twice: on the narrow twin (make test) and at SmolLM2's width and vocabulary (slow: make test-all).
pytestmark = pytest.mark.usefixtures("from_config_shape")

KIND = "answers"  # uneven targets per row (float64.answer_rows)


def _ref(**kw) -> f64.Run:
    """A reference run, kept for the file's tests of the current shape: ``f64.lm_run(KIND, **kw)``. Every knob's
    reference is the fused head at 8 x 1 (it projects only the targets: several times faster), which equals the
    whole logits (test_same_training.py::test_the_fused_head_is_the_whole_logits_*)."""
    return _ref_of(f64.current_shape(), **kw)


@functools.cache
def _ref_of(shape: str, **kw) -> f64.Run:
    return f64.lm_run(KIND, **kw)


@pytest.mark.parametrize("micro,accum", [(4, 2), (1, 8)])
def test_splits_of_the_effective_batch_are_the_same_training(micro, accum):
    f64.assert_same(f64.lm_run(KIND, micro=micro, accum=accum), _ref())


def test_padding_free_is_the_same_training_as_padded():
    f64.assert_same(f64.lm_run(KIND, micro=2, accum=4, padding_free=True), _ref())


def test_both_backends_are_the_same_training():
    f64.assert_same(f64.lm_run(KIND, micro=2, accum=4, backend="accelerate", padding_free=True), _ref())


@pytest.mark.parametrize("ckpt", [{"use_reentrant": False}, {"use_reentrant": True, "every_n_layers": 2}])
def test_checkpointing_is_the_same_training(ckpt):
    f64.assert_same(f64.lm_run(KIND, micro=2, accum=4, checkpointing=tuple(ckpt.items())), _ref())


def test_the_attention_kernel_eager_is_sdpa_in_float64():
    """Eager attention against SDPA, with eager's softmax in float64 (transformers' takes it in float32
    whatever the model's dtype, 2e-7 off in float64: float64.py's ``float64_throughout``)."""
    f64.assert_same(f64.lm_run(KIND, attn="eager"), _ref())


def test_the_splits_proof_sees_a_mean_of_micro_batch_means(monkeypatch):
    """The accumulation bug the splits are proven against, planted: each micro-batch's loss its own mean
    over its targets, divided by the accumulation count (the loss of a Trainer without
    ``num_items_in_batch``). On these rows the 4 x 2 micro-batches hold different numbers of targets, and
    the proof's distance to 8 x 1 is far above its 1e-12; the same loss at 8 x 1 (one micro-batch a step)
    is the exact one. (On the ``yes_no`` rows, 3 targets each, this loss would pass the proof.)"""
    from onegpu.training.objectives import loss
    ref, exact, accum = _ref(), loss.causal_lm_loss, 2  # the reference trained with the exact loss
    targets = [sum(t != -100 for t in row[1:]) for row in f64.instruction_data(KIND, 16)["train"]["labels"]]
    assert min(targets) == 3 and max(targets) == 9, targets

    def mean_of_means(outputs, labels, num_items_in_batch=None):
        return exact(outputs, labels, None) / accum
    monkeypatch.setattr(loss, "causal_lm_loss", mean_of_means)
    d = f64.distance(f64.lm_run(KIND, micro=4, accum=accum), ref)
    assert min(d["loss"], d["grad_norm"], d["gradient"]) > 1e-5, d  # measured: 5e-4, 1e-2, 0.1
