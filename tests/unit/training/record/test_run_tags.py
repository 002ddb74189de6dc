"""What a training run says about itself (onegpu.training.record.run_tags): its name from its settings, the
runs table's tags in people's units."""
from __future__ import annotations

from onegpu.config import from_container
from onegpu.training.record import run_tags

AUTO = {"per_device_train_batch_size": "auto", "effective_batch_size": 8, "memory_budget_gib": 1}


def _cfg(**train):
    return from_container({"train": train}, source="test")


def test_config_name_names_the_split_the_precision_and_the_knobs_that_are_on():
    assert run_tags.config_name(_cfg(per_device_train_batch_size=4, gradient_accumulation_steps=4)) == "bs4x4-fp32"
    assert run_tags.config_name(_cfg(**AUTO, bf16=True, backend="accelerate")) == "bsauto-eff8-bf16-accelerate"
    lora = from_container({"model": {"lora": {"r": 8}}, "train": {"optim": "adafactor"}}, source="test")
    assert run_tags.config_name(lora) == "bs8x1-fp32-lora-r8-adafactor"
    sharded = _cfg(backend="accelerate", num_processes=4, num_machines=2, main_process_ip="10.0.0.1",
                   eval_strategy="no", oom_retry=False)
    assert run_tags.config_name(sharded) == "bs8x1x4proc-2machines-fp32-accelerate"
    sharded = _cfg(backend="accelerate", num_processes=2, fsdp={"enabled": True}, oom_retry=False)
    assert run_tags.config_name(sharded) == "bs8x1x2proc-fp32-fsdp-accelerate"




def test_a_short_last_step_is_tagged_and_said_once_over_the_processes(monkeypatch, capsys):
    """onegpu.partial_steps on every process; the line on the terminal from process 0 only (it was printed once per
    process under train.num_processes)."""
    import json
    import types

    from onegpu.training.record import run_tags
    steps = types.SimpleNamespace(window_start=None, window_end=None,
                                  partial_steps=lambda batch: [{"step": 16, "examples": 20}])
    for rank, said in (("1", ""), ("0", "train: optimizer step 16 saw 20 of 32 examples (the epoch's last rows); "
                                        "its loss is the mean over those\n")):
        monkeypatch.setenv("RANK", rank)
        tags = run_tags.step_tags(steps, 32)
        assert json.loads(tags["onegpu.partial_steps"]) == [{"step": 16, "examples": 20}]
        assert capsys.readouterr().out == said
