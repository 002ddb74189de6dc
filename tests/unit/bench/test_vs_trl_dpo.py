"""bench.vs_trl_dpo's arms on a tiny Llama with the packaged tokenizer: onegpu's DPO step and TRL's DPOTrainer
on the same micro-batches of as many pairs agree per step in fp32 (loss, grad_norm, rewards/*), and onegpu saves no
more bytes for backward than TRL; with ``--bf16`` each arm trains again under bf16 autocast, reported as its
per-step difference from its fp32 run (the GPU check's ``dpo`` section), never as equal to it."""
from __future__ import annotations

import argparse
import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("trl")

from bench import vs_trl_dpo  # noqa: E402
from onegpu.config import from_container  # noqa: E402
from tests.unit.equivalence import float64  # noqa: E402
from tests.unit.training.objectives import test_batches as tb  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs():
    """Each run of ``run_names(bf16=True)`` (onegpu, trl, onegpu-bf16, trl-bf16): 3 steps of 2 x 2 pairs, CPU."""
    from onegpu.models import lora
    cfg = from_container({"data": {"source": "pairs.jsonl"},
                          "model": {"task": "preference", "name_or_path": None, "lora": {"r": 4, "alpha": 8.0}},
                          "train": {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2,
                                    "max_steps": 3, "learning_rate": 1e-2}}, source="test")

    def model():  # the job's: LoRA, so both references are the base under the disabled adapter
        return lora.apply(tb.tiny_llama(), cfg.model.lora, "preference")
    pairs = [dict(r) for r in float64.preference_data(12)["train"].remove_columns(
        ["prompt", "chosen", "rejected", "label", "length"])]
    steps = [[pairs[s * 4 + m * 2:s * 4 + m * 2 + 2] for m in range(2)] for s in range(3)]
    digests = [vs_trl_dpo.digest(mb) for step in steps for mb in step]
    tok = tb.tokenizer()
    out = {}
    try:
        for name in vs_trl_dpo.run_names(bf16=True):
            arm = vs_trl_dpo.Arm(name.removesuffix(vs_trl_dpo.BF16), model(), cfg, tok, "cpu",
                                 bf16=name.endswith(vs_trl_dpo.BF16))
            out[name] = [vs_trl_dpo.train_arm(arm, steps, "cpu", digests)]
    finally:  # each DPOTrainer set Accelerate's one mixed-precision setting per process; later tests set their own
        from accelerate.state import AcceleratorState
        AcceleratorState._reset_state(True)
    return out, digests


def test_onegpu_and_trl_train_the_same_dpo_steps_and_onegpu_saves_no_more(runs):
    runs, _ = runs
    one, trl = runs["onegpu"][0], runs["trl"][0]
    assert one["rows"][0]["loss"] == pytest.approx(0.6931471805599453, abs=1e-6)
    d = vs_trl_dpo.largest_differences(one["rows"], trl["rows"])
    assert all(d[k] <= 1e-5 for k in ("loss", "grad_norm", "rewards/margins", "rewards/chosen",
                                      "rewards/rejected")), d
    assert d["rewards/accuracies"] == 0, d
    assert one["rows"][2]["rewards/accuracies"] > 0  # the steps moved the policy
    assert one["saved_bytes"] <= trl["saved_bytes"], (one["saved_bytes"], trl["saved_bytes"])


def test_bf16_runs_under_autocast_and_are_reported_as_their_difference_from_fp32(runs):
    runs, digests = runs
    diff = vs_trl_dpo.bf16_minus_fp32(runs)
    for arm in vs_trl_dpo.ARMS:
        fp32, bf16 = runs[arm][0]["rows"], runs[arm + vs_trl_dpo.BF16][0]["rows"]
        assert bf16[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)  # policy = reference at step 1 in bf16 too
        assert bf16[0]["grad_norm"] != fp32[0]["grad_norm"]  # autocast is on: bf16 matmuls, another gradient
        assert bf16[0]["grad_norm"] == pytest.approx(fp32[0]["grad_norm"], rel=0.05)  # ... of the same step
        assert [d["loss"] for d in diff[arm]] == [b["loss"] - f["loss"] for b, f in zip(bf16, fp32)]
        assert set(diff[arm][0]) == {"loss", "grad_norm", *vs_trl_dpo.FIGURES}
    args = argparse.Namespace(steps=3, micro=2, accum=2, lora=4, max_length=64, lr=1e-2, reps=1, bf16=True)
    text = "\n".join(vs_trl_dpo.report_lines(args, runs, digests, [0.5, 0.7], "tiny"))
    assert "bf16 autocast against fp32" in text and "loss bf16 - fp32" in text and "Largest |bf16 - fp32|" in text
    assert "equal" not in text.lower()  # a difference, never a claim of equality
    for name in vs_trl_dpo.run_names(bf16=True):
        assert f"| {name} " in text  # saved bytes, peak and step time of every run
    plain = "\n".join(vs_trl_dpo.report_lines(argparse.Namespace(**{**vars(args), "bf16": False}),
                                              {a: runs[a] for a in vs_trl_dpo.ARMS}, digests, [0.5], "tiny"))
    assert "bf16" not in plain


def test_without_lora_a_frozen_copy_is_trls_ref_model_per_step():
    """Every weight trains, so onegpu's reference is its frozen copy and TRL's the ``ref_model`` the arm passes
    (a copy of the same weights): step 1 is ln 2 in both and 2 steps of 2 x 2 agree within 1e-5 (a reference
    whose logits moved 1e-3 from the policy's, as once seen here, would fail step 1)."""
    cfg = from_container({"data": {"source": "pairs.jsonl"}, "model": {"task": "preference", "name_or_path": None},
                          "train": {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2,
                                    "max_steps": 2, "learning_rate": 1e-2}}, source="test")
    pairs = [dict(r) for r in float64.preference_data(8)["train"].remove_columns(
        ["prompt", "chosen", "rejected", "label", "length"])]
    steps = [[pairs[s * 4 + m * 2:s * 4 + m * 2 + 2] for m in range(2)] for s in range(2)]
    digests = [vs_trl_dpo.digest(mb) for step in steps for mb in step]
    rows = {}
    try:
        for name in vs_trl_dpo.ARMS:
            arm = vs_trl_dpo.Arm(name, tb.tiny_llama(), cfg, tb.tokenizer(), "cpu")
            rows[name] = vs_trl_dpo.train_arm(arm, steps, "cpu", digests)["rows"]
    finally:
        from accelerate.state import AcceleratorState
        AcceleratorState._reset_state(True)
    assert [r[0]["loss"] for r in rows.values()] == pytest.approx([math.log(2)] * 2, abs=1e-7)
    d = vs_trl_dpo.largest_differences(rows["onegpu"], rows["trl"])
    assert all(d[k] <= 1e-5 for k in ("loss", "grad_norm", "rewards/margins")), d
    assert rows["onegpu"][1]["loss"] != rows["onegpu"][0]["loss"]  # the first step moved the policy


def test_model_option_names_the_model_directory():
    args = argparse.Namespace(max_length=64, rows=8, lora=8, micro=2, accum=1, steps=1, lr=1e-3,
                              model="/somewhere/smollm2-random-init")
    assert vs_trl_dpo.dpo_cfg(args).model.name_or_path == "/somewhere/smollm2-random-init"
    assert vs_trl_dpo.run_names(bf16=False) == ["onegpu", "trl"]
    assert vs_trl_dpo.run_names(bf16=True) == ["onegpu", "trl", "onegpu-bf16", "trl-bf16"]
