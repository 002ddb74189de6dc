"""bench.vs_trl_dpo's arms on a tiny Llama with the packaged tokenizer: onegpu's DPO step and TRL's DPOTrainer
on the same micro-batches of as many pairs agree per step (loss, grad_norm, rewards/*), and onegpu saves no
more bytes for backward than TRL."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("trl")

from bench import vs_trl_dpo  # noqa: E402
from onegpu.config import from_container  # noqa: E402
from tests.unit.equivalence import float64  # noqa: E402
from tests.unit.training import test_batches as tb  # noqa: E402

pytestmark = pytest.mark.slow


def test_onegpu_and_trl_train_the_same_dpo_steps_and_onegpu_saves_no_more():
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
    runs = {name: vs_trl_dpo.train_arm(vs_trl_dpo.Arm(name, model(), cfg, tok, "cpu"), steps, "cpu", digests)
            for name in vs_trl_dpo.ARMS}
    assert runs["onegpu"]["rows"][0]["loss"] == pytest.approx(0.6931471805599453, abs=1e-6)
    d = vs_trl_dpo.largest_differences(runs["onegpu"]["rows"], runs["trl"]["rows"])
    assert d["loss"] <= 1e-5 and d["grad_norm"] <= 1e-5 and d["rewards/margins"] <= 1e-5, d
    assert d["rewards/accuracies"] == 0, d
    assert runs["onegpu"]["rows"][2]["rewards/accuracies"] > 0  # the steps moved the policy
    assert runs["onegpu"]["saved_bytes"] <= runs["trl"]["saved_bytes"], (runs["onegpu"]["saved_bytes"],
                                                                          runs["trl"]["saved_bytes"])
