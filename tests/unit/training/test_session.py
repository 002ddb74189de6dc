"""The training session's plan (onegpu.training.session.plan): layout once, key, resume point."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

from onegpu.config import Resolved, from_container  # noqa: E402
from onegpu.equivalence import equivalence_key  # noqa: E402
from onegpu.training import session  # noqa: E402
from onegpu.training.resume import STATE_FILE  # noqa: E402

STATS = {"fingerprint": "f" * 16, "labels": ["a", "b"]}
AUTO = {"per_device_train_batch_size": "auto", "effective_batch_size": 8, "memory_budget_gib": 1}


def _cfg(**train):
    return from_container({"train": train}, source="test")


def test_fixed_split_is_resolved_in_the_plan_and_auto_waits_for_the_finder(tmp_path, monkeypatch):
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))
    fixed = session.plan(_cfg(per_device_train_batch_size=4, gradient_accumulation_steps=2), STATS)
    assert fixed.resolved == Resolved(4, 2, 1) and fixed.budget is None and fixed.resume is None
    assert fixed.device == "cpu" and fixed.checkpoint_dir.parent == tmp_path / ".onegpu" / "checkpoints"
    auto = session.plan(_cfg(**AUTO), STATS)
    assert auto.resolved is None and auto.budget == 2**30
    # the key reads the effective batch only: the same for any split of 8
    assert auto.key == fixed.key == equivalence_key(fixed.cfg, Resolved(8, 1, 1), STATS["fingerprint"])


def test_auto_resumes_with_the_split_its_checkpoint_was_written_with(tmp_path, monkeypatch):
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))
    first = session.plan(_cfg(**AUTO), STATS)
    d = first.checkpoint_dir / "checkpoint-3"
    d.mkdir(parents=True)
    (d / STATE_FILE).write_text(json.dumps({"step": 3, "rows": [], "run_id": "r1", "micro_batch": 2}))
    again = session.plan(_cfg(**AUTO), STATS)
    assert (again.resume.step, again.resume.run_id) == (3, "r1")
    assert again.resolved == Resolved(2, 4, 1)


def test_a_combination_the_machine_cannot_run_stops_the_plan_before_the_data_is_read(tmp_path, monkeypatch):
    from onegpu.config import DeviceFacts
    from onegpu.errors import ConfigError
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))  # no data/stats.json here: a DataError if it got that far
    with pytest.raises(ConfigError, match="train.fp16: fp16 mixed precision needs a CUDA GPU"):
        session.plan(_cfg(fp16=True), facts=DeviceFacts())
    assert session.plan(_cfg(tf32=True), STATS, facts=DeviceFacts()).device == "cpu"  # TF32: a no-op on CPU
    gpu = DeviceFacts(cuda=True, gpus=1, name="NVIDIA H200", bf16=True, tf32=True)
    assert session.plan(_cfg(), STATS, facts=gpu).device == "cuda:0"


def test_the_auto_finder_probes_under_the_trainings_precision(tmp_path, monkeypatch, tokenizer, dsd):
    """With bf16 the finder must probe under autocast (bf16 activations are smaller, so a larger
    micro-batch fits); the session used to call it without the precision."""
    from onegpu import autobatch
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))
    seen = {}

    def finder(*args, **kw):
        seen.update(kw)
        return 4, []
    monkeypatch.setattr(autobatch, "find_micro_batch", finder)

    class Tracker:
        def log_dict(self, *a):
            pass

        def log_text(self, *a):
            pass
    import torch
    plan = session.plan(_cfg(**AUTO, bf16=True), STATS)
    micro = session._find_micro_batch(torch.nn.Linear(2, 2), tokenizer, dsd, plan, Tracker(), "run")
    assert micro == 4 and seen["mixed_precision"] == "bf16"
