"""`dvc exp run` with `auto` micro-batch and with LoRA's dotted `-S` on a copy of the tiny project on which
`dvc repro` ran (conftest's ``project``; its own file, beside test_pipeline.py, so that pytest-xdist runs the
two at once)."""
from __future__ import annotations

import pytest

from .conftest import dvc, run
from .test_pipeline import MAX_STEPS, _training_runs


@pytest.mark.slow  # make test-all: `dvc exp run` itself is make test's in the LoRA test below
def test_auto_micro_batch_keeps_the_effective_batch_and_the_losses(project):
    run(["git", "checkout", "--", "."], project)
    dvc(project, "checkout", "--force")
    out = dvc(project, "exp", "run", "train", "-S", "train.per_device_train_batch_size=auto",  # no eval read
              "-S", "train.effective_batch_size=32", "-S", "train.memory_budget_gib=0.5").stdout
    assert "auto micro-batch:" in out, out
    c, exp, train = _training_runs(project)
    auto = [r for r in train if r.data.params.get("train.per_device_train_batch_size") == "auto"]
    assert len(auto) == 1
    p = auto[0].data.params
    micro, accum = int(p["resolved.per_device_train_batch_size"]), int(p["resolved.gradient_accumulation_steps"])
    assert micro < 32 and micro * accum == 32 == int(p["resolved.effective_batch_size"])
    arts = {a.path for a in c.list_artifacts(auto[0].info.run_id)}
    assert {"auto_micro_batch.json", "auto_micro_batch.md"} <= arts

    dvc(project, "exp", "run", "train", "-S", f"train.per_device_train_batch_size={micro}",  # train: all read here
        "-S", f"train.gradient_accumulation_steps={accum}", "-S", "train.memory_budget_gib=null")
    c, exp, train = _training_runs(project)
    hand = [r for r in train if r.data.params.get("train.per_device_train_batch_size") == str(micro)
            and r.data.params.get("train.effective_batch_size") == "32"]
    assert len(hand) == 1
    assert hand[0].data.tags["equivalence_key"] == auto[0].data.tags["equivalence_key"]
    a = [m.value for m in sorted(c.get_metric_history(auto[0].info.run_id, "loss"), key=lambda m: m.step)]
    b = [m.value for m in sorted(c.get_metric_history(hand[0].info.run_id, "loss"), key=lambda m: m.step)]
    assert len(a) == len(b) == MAX_STEPS
    assert max(abs(x - y) for x, y in zip(a, b)) < 1e-6, (a, b)  # the probes changed nothing


def test_exp_run_dotted_lora_rank_trains_lora(project):
    """`dvc exp run -S model.lora.r=8`, the form a user types first: a LoRA run (adapters only train,
    another equivalence key, the adapter saved), from params.yaml's mapping with r: 0. (Up to train: the
    merged model's evaluation is tests/unit/models/test_lora.py's.)"""
    run(["git", "checkout", "--", "."], project)
    dvc(project, "checkout", "--force")
    out = dvc(project, "exp", "run", "train", "-S", "model.lora.r=8").stdout
    c, exp, train = _training_runs(project)
    lora = [r for r in train if r.data.params.get("model.lora.r") == "8"]
    assert len(lora) == 1, out
    base = [r for r in train if not r.data.tags.get("dvc.exp_name")][0]
    assert base.data.params["model.lora.r"] == "0"
    tags = lora[0].data.tags
    assert int(tags["model.trainable_parameters"]) < int(tags["model.parameters"]) / 20
    assert int(base.data.tags["model.trainable_parameters"]) == int(base.data.tags["model.parameters"])
    assert tags["equivalence_key"] != base.data.tags["equivalence_key"]
    assert (project / "models" / "adapter" / "adapter_config.json").is_file()
    assert len(c.get_metric_history(lora[0].info.run_id, "loss")) == MAX_STEPS
