"""The likely causes of a divergence, from params and tags (onegpu.compare.causes)."""
from __future__ import annotations

import pytest

from onegpu import compare as eq
from tests.unit.compare.records import _with, drifted, record


def test_dropout_cause_only_when_the_split_differs():
    ref = record("ref", 64, 1, dropout=0.1)
    split = eq.compare_run(record("split", 4, 16, dropout=0.1, loss=drifted(1)), ref)
    assert any(c.startswith("dropout") and "different dropout masks" in c for c in split.causes)
    # Same micro-batch, checkpointing on: the same masks (checkpointing restores the RNG state).
    ckpt = eq.compare_run(record("ckpt", 64, 1, ckpt=True, dropout=0.1), ref)
    assert not any("dropout" in c for c in ckpt.causes)
    # Another attention kernel or torch.compile draws other masks too (same split).
    for knob, value in (("model.attn_implementation", "eager"), ("train.torch_compile", "True")):
        other = record("kernel", 64, 1, dropout=0.1, loss=drifted(1))
        other.params[knob] = value
        c = eq.compare_run(other, ref)
        assert any(x.startswith("dropout") and f"({knob} differs)" in x for x in c.causes), c.causes
    # No dropout at all: no dropout cause, whatever the split.
    plain = eq.compare_run(record("split0", 4, 16), record("ref0", 64, 1))
    assert not any("dropout" in c for c in plain.causes)


def test_batchnorm_cause_with_a_different_micro_batch():
    ref = record("ref", 64, 1, batchnorm=3)
    c = eq.compare_run(record("split", 8, 8, batchnorm=3, loss=drifted(1)), ref)
    assert c.verdict == "diverged at step 1"
    assert any("BatchNorm" in x and "per micro-batch" in x for x in c.causes)
    same = eq.compare_run(record("ckpt", 64, 1, ckpt=True, batchnorm=3), ref)
    assert not any("BatchNorm" in x for x in same.causes)


def test_a_cause_is_named_only_where_the_run_differs_from_the_reference():
    ref = record("ref", 64, 1, bf16=True, device="NVIDIA H200")
    c = eq.compare_run(record("acc", 4, 16, bf16=True, device="NVIDIA H200", backend="accelerate"), ref)
    assert c.causes == ["a different backend (accelerate vs trainer): the training loops order the work differently"]
    fp32 = eq.compare_run(record("fp32", 4, 16, device="NVIDIA H200"), ref)
    assert any(x.startswith("mixed precision (bf16)") for x in fp32.causes), fp32.causes


def test_a_divergent_run_that_differs_in_no_setting_is_given_no_cause_but_the_knobs_on_in_both():
    """The issue's case: 2 x 4 with the fused head against 8 x 1 with it, padding-free in neither."""
    knobs = {"train.fused_lm_head": True, "data.padding_free": False}
    ref = _with(record("sft-8x1", 8, 1), **knobs)
    c = eq.compare_run(_with(record("sft-2x4", 2, 4, loss=drifted(3)), **knobs), ref)
    assert c.verdict == "diverged at step 3" and c.causes == []
    assert c.no_cause == ("no setting differs from the reference: a numerical difference in the loss path "
                          "(on in both runs: the fused LM head)")
    gpu = eq.compare_run(record("b", 4, 16, bf16=True, device="NVIDIA H200", loss=drifted(2, rel=0.1)),
                         record("ref", 64, 1, bf16=True, device="NVIDIA H200"))
    assert gpu.causes == [] and gpu.no_cause.endswith("(on in both runs: bf16, non-deterministic GPU kernels "
                                                      "(NVIDIA H200))")
    pf = eq.compare_run(_with(record("sft-2x4-pf", 2, 4, loss=drifted(3)), **{**knobs, "data.padding_free": True}),
                        ref)
    assert pf.causes and pf.causes[0].startswith("data.padding_free differs (true vs false)") and not pf.no_cause
    whole = eq.compare_run(_with(record("whole", 2, 4, loss=drifted(3)), **{**knobs, "train.fused_lm_head": False}),
                           ref)
    assert [x.split(":")[0] for x in whole.causes] == ["train.fused_lm_head differs (false vs true)"]


@pytest.mark.parametrize("param,value,named", [
    ("train.tf32", True, "train.tf32 differs (true vs false)"),
    ("model.attn_implementation", "eager", "model.attn_implementation differs (eager vs none)"),
    ("train.torch_compile", True, "train.torch_compile differs (true vs false)"),
    ("train.optim", "adamw_torch_fused", "train.optim differs (adamw_torch_fused vs adamw_torch)"),
    ("train.torch_empty_cache_steps", 4, "train.torch_empty_cache_steps differs (4 vs none)"),
])
def test_compare_names_the_knob_that_differs_when_runs_diverge(param, value, named):
    ref = _with(record("ref", 64, 1), **{"train.optim": "adamw_torch", "train.tf32": False,
                                         "model.attn_implementation": None, "train.torch_compile": False,
                                         "train.torch_empty_cache_steps": None})
    run = _with(record("k", 64, 1, loss=drifted(3)), **{param: value})
    c = eq.compare_run(run, ref)
    assert c.verdict == "diverged at step 3"
    assert any(cause.startswith(named) for cause in c.causes), c.causes
    # the same knob on both sides (or a run logged before the knob existed, read as the default) is no cause
    same = eq.compare_run(_with(record("s", 64, 1, loss=drifted(3)), **{"train.optim": "adamw_torch"}), ref)
    assert not any(param in cause for cause in same.causes), same.causes


@pytest.mark.parametrize("optim,bits", [("adamw_torch_8bit", 8), ("adamw_torch_4bit", 4), ("adamw_bnb_8bit", 8)])
def test_low_bit_adamw_against_adamw_names_the_quantised_states(optim, bits):
    ref = _with(record("fp32", 64, 1), **{"train.optim": "adamw_torch"})
    run = _with(record("low", 64, 1, loss=drifted(2), key="another key"), **{"train.optim": optim})
    c = eq.compare_run(run, ref)
    optim_causes = [x for x in c.causes if "train.optim" in x]
    assert optim_causes == [
        f"train.optim differs ({optim} vs adamw_torch): {optim} keeps AdamW's two moments quantised to {bits} bits "
        "(block-wise, one fp32 scale per block), so its steps differ from fp32 AdamW's by design (another "
        "training with its own equivalence key, not a rounding difference)"], c.causes
    # 8-bit against 4-bit: both named; the same low-bit optimizer on both sides is no cause
    both = eq.compare_run(_with(record("4", 64, 1), **{"train.optim": "adamw_torch_4bit"}),
                          _with(record("8", 64, 1), **{"train.optim": "adamw_torch_8bit"}))
    assert [x for x in both.causes if "quantised to 4 bits" in x and "adamw_torch_8bit keeps" in x], both.causes
    same = eq.compare_run(_with(record("s", 64, 1, loss=drifted(2)), **{"train.optim": optim}), run)
    assert not any("train.optim" in x for x in same.causes), same.causes


def test_padding_free_is_the_same_training_compared_within_fp32_tolerance():
    ref = _with(record("padded", 8, 2), **{"data.padding_free": False})
    # equal losses up to summation order: equivalent at the fp32 tolerance, and padding_free is no cause
    same = eq.compare_run(_with(record("flat", 8, 2, loss=drifted(99)), **{"data.padding_free": True}), ref)
    assert (same.verdict, same.precision) == ("equivalent", "fp32")
    # beyond the tolerance: padding_free is named, as the same training that should not have moved
    off = eq.compare_run(_with(record("flat", 8, 2, loss=drifted(2)), **{"data.padding_free": True}), ref)
    assert off.verdict == "diverged at step 2"
    assert off.causes[0].startswith("data.padding_free differs (true vs false): the same training"), off.causes
    # a run logged before the knob existed reads as padded: no cause against a padded reference
    old = eq.compare_run(record("old", 8, 2, loss=drifted(2)), ref)
    assert not any("padding_free" in c for c in old.causes), old.causes


@pytest.mark.parametrize("param,value,default,says", [
    ("data.packing", True, False, "its own equivalence key"),
    ("data.completion_only_loss", False, None, "a different training"),
    ("data.assistant_only_loss", True, False, "a different training"),
])
def test_packing_and_loss_masks_are_named_with_what_they_change(param, value, default, says):
    ref = _with(record("ref", 8, 2), **{param: default})
    c = eq.compare_run(_with(record("run", 8, 2, loss=drifted(1)), **{param: value}), ref)
    named = [x for x in c.causes if x.startswith(f"{param} differs")]
    assert len(named) == 1 and says in named[0], c.causes
    assert not any(x.startswith(param) for x in eq.compare_run(_with(record("s", 8, 2), **{param: default}),
                                                                 ref).causes)


def test_fsdp2_sharding_is_named_when_it_differs_and_a_classifiers_fused_head_never():
    """Seen on the default classifier: FSDP2 against plain data parallel diverged at step 1 (grad_norm 1.7e-6
    apart) and the note said "no setting differs ... (on in both runs: the fused LM head)", a head a classifier
    does not have."""
    ref = _with(record("dp2", 8, 2), **{"model.task": "sequence-classification", "train.fused_lm_head": True,
                                        "train.fsdp.enabled": False})
    run = _with(record("fsdp2", 8, 2, loss=drifted(3)), **{"model.task": "sequence-classification",
                                                           "train.fused_lm_head": True, "train.fsdp.enabled": True})
    c = eq.compare_run(run, ref)
    assert [x.split(":")[0] for x in c.causes] == ["train.fsdp.enabled differs (true vs false)"]
    both = eq.compare_run(_with(record("fsdp2b", 8, 2, loss=drifted(3)), **{"train.fsdp.enabled": False,
                                                                            "model.task": "sequence-classification"}),
                          ref)  # (train.fused_lm_head not logged: a classifier's is no cause either)
    assert both.causes == [] and both.no_cause == ("no setting differs from the reference: a numerical "
                                                   "difference in the loss path")
