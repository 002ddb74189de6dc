"""Ctrl-C during train: a checkpoint, a KILLED MLflow run, and a next run that resumes to the same result.

The same with LoRA adapters (the checkpoint holds the adapters and the head; the resumed run rebuilds the
model and loads them) on both backends: tests/unit/test_lora.py, in-process, since the stage's path from
Ctrl-C to the resumed run is the one checked here."""
from __future__ import annotations

import csv
import os
import signal
import subprocess

import pytest
from safetensors.torch import load_file

from .conftest import BIN, _env, run, runs

pytestmark = pytest.mark.slow


def _losses(project):
    with open(project / "plots/train_steps.csv") as f:
        return [float(r["loss"]) for r in csv.DictReader(f)]


def _interrupt_after_the_first_step(project) -> None:
    """``onegpu train`` with SIGINT once the first optimizer step is done: it must save a checkpoint and
    exit 130."""
    env = {**_env(), "PYTHONUNBUFFERED": "1"}
    p = subprocess.Popen([str(BIN / "onegpu"), "train"], cwd=project, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    seen = []
    for line in p.stdout:
        seen.append(line)
        if " | loss " in line:  # the first optimizer step is done
            p.send_signal(signal.SIGINT)
            break
    rest = p.stdout.read()
    assert p.wait(timeout=300) == 130, "".join(seen) + rest
    assert "checkpoint saved" in rest and "Traceback" not in rest, rest


def test_sigint_checkpoints_and_the_next_run_resumes_to_identical_losses_and_weights(tmp_path, prepared):
    project = prepared(tmp_path, {"train": {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2,
                                            "max_steps": 10, "logging_steps": 1},
                                  "model": {"dropout": 0.1}})  # dropout: the RNG state must resume too
    onegpu = str(BIN / "onegpu")
    run([onegpu, "train"], project)
    reference = _losses(project), load_file(project / "models/model/model.safetensors")

    _interrupt_after_the_first_step(project)
    ckpts = list((project / ".onegpu" / "checkpoints").glob("*/checkpoint-*"))
    assert len(ckpts) == 1 and (ckpts[0] / "model.safetensors").is_file()
    stopped_at = int(ckpts[0].name.split("-")[1])
    assert 1 <= stopped_at < 10

    out = run([onegpu, "train"], project).stdout
    assert "resuming from" in out
    assert _losses(project) == pytest.approx(reference[0], abs=1e-6)
    weights = load_file(project / "models/model/model.safetensors")
    assert max(float((weights[k] - reference[1][k]).abs().max()) for k in weights) <= 1e-6
    assert not list((project / ".onegpu" / "checkpoints").glob("*/checkpoint-*"))  # cleaned up after success

    c, exp, all_runs = runs(project)
    train = {r.info.run_id: r for r in all_runs if r.data.tags.get("stage") == "train"}
    killed = [r for r in train.values() if r.info.status == "KILLED"]
    assert len(killed) == 1
    resumed = [r for r in train.values() if r.data.tags.get("onegpu.resumed_from") == killed[0].info.run_id]
    assert len(resumed) == 1
    assert killed[0].data.tags.get("onegpu.resumed_by") == resumed[0].info.run_id
    assert len(c.get_metric_history(killed[0].info.run_id, "loss")) == stopped_at  # nothing measured lost
    steps = sorted(m.step for m in c.get_metric_history(resumed[0].info.run_id, "loss"))
    assert steps == list(range(1, 11))  # the resumed run carries the whole curve
