"""Data-parallel training on a CPU (2 gloo processes under torch.distributed.run), read back from MLflow.

2 processes x 4 x 1, 1 x 8 x 1 and 1 x 4 x 2 are the same effective batch of 8: the same equivalence key
and, per optimizer step, the same loss and grad_norm within 1e-5 relative, for both tasks (the causal LM
pads each micro-batch to its own longest row, so the step's token count must be summed over the ranks
before normalising) and both backends. Each training is one MLflow run, not one per rank.
"""
from __future__ import annotations

import pytest
import yaml

from .conftest import BIN, run, runs

pytestmark = pytest.mark.slow

TASKS = {
    "sequence-classification": {"data": {"max_train_samples": 32, "max_eval_samples": 16, "max_length": 32}},
    "causal-lm": {
        "data": {"max_train_samples": 32, "max_eval_samples": 16, "max_length": 48},
        "model": {"task": "causal-lm", "name_or_path": None, "n_layer": 2, "n_embd": 64, "n_head": 2,
                  "vocab_size": 512, "dropout": 0.0},
    },
}
# (processes, micro-batch, accumulation): the same effective batch of 8.
LAYOUTS = [(2, 4, 1), (1, 8, 1), (1, 4, 2)]
STEPS = 3


def _train(project, backend: str, layout: tuple[int, int, int]) -> None:
    """`onegpu train` (the train stage's command) with this backend and layout in params.yaml."""
    procs, micro, accum = layout
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["train"].update(backend=backend, num_processes=procs, per_device_train_batch_size=micro,
                           gradient_accumulation_steps=accum, max_steps=STEPS, learning_rate=1e-3)
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    out = run([str(BIN / "onegpu"), "train"], cwd=project)
    if procs > 1:
        assert f"({micro} x {accum} x {procs} processes)" in out.stdout, out.stdout


def _series(client, run_id: str, key: str) -> list[float]:
    return [m.value for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)]


@pytest.mark.parametrize("task", list(TASKS))
def test_two_processes_equal_one_process_per_step(tmp_path, prepared, task):
    project = prepared(tmp_path, TASKS[task])
    for backend in ("trainer", "accelerate"):
        for layout in LAYOUTS:
            _train(project, backend, layout)
    c, _, all_runs = runs(project)
    train = [r for r in all_runs if r.data.tags.get("stage") == "train"]
    assert len(train) == 6  # one run per training, not one per process
    assert {r.info.status for r in train} == {"SCHEDULED"}
    assert len({r.data.tags["equivalence_key"] for r in train}) == 1
    by = {(r.data.params["train.backend"], int(r.data.params["resolved.world_size"]),
           int(r.data.params["resolved.per_device_train_batch_size"]),
           int(r.data.params["resolved.gradient_accumulation_steps"])): r for r in train}
    assert set(by) == {(b, *lay) for b in ("trainer", "accelerate") for lay in LAYOUTS}
    assert {r.data.params["resolved.effective_batch_size"] for r in train} == {"8"}
    ref = by[("trainer", 1, 8, 1)].info.run_id
    for key in ("loss", "grad_norm"):
        expected = _series(c, ref, key)
        assert len(expected) == STEPS
        for name, r in by.items():
            got = _series(c, r.info.run_id, key)
            assert got == pytest.approx(expected, rel=1e-5), (key, name, got, expected)
    for backend in ("trainer", "accelerate"):
        two = by[(backend, 2, 4, 1)]
        m = two.data.metrics
        # The whole step's counts: 8 examples over both ranks; a per-rank breakdown beside them.
        assert _series(c, two.info.run_id, "step_examples") == [8.0] * STEPS
        assert m["mem_peak_bytes"] == max(m["mem_peak_bytes.rank0"], m["mem_peak_bytes.rank1"])
        assert m["step_tokens"] == _series(c, ref, "step_tokens")[-1]
        assert "samples_per_second.rank1" in m


@pytest.mark.parametrize("backend", ["trainer", "accelerate"])
def test_two_processes_stop_on_sigterm_and_resume_to_the_uninterrupted_losses(tmp_path, prepared, backend):
    """SIGTERM to `onegpu train` (as `dvc queue kill` sends it): the processes stop after the same step with
    one checkpoint, the run ends KILLED, and the next `onegpu train` resumes it on 2 processes to the
    losses of an uninterrupted run."""
    import os
    import signal
    import subprocess

    from .conftest import _env
    project = prepared(tmp_path, TASKS["causal-lm"])
    steps = 24
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["train"].update(backend=backend, num_processes=2, per_device_train_batch_size=4,
                           gradient_accumulation_steps=1, max_steps=steps, learning_rate=1e-3, logging_steps=1)
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    p = subprocess.Popen([str(BIN / "onegpu"), "train"], cwd=project, env=_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in p.stdout:
        lines.append(line)
        if line.startswith("step 2/"):
            os.kill(p.pid, signal.SIGTERM)
            break
    rest = p.communicate(timeout=300)[0]
    out = "".join(lines) + rest
    assert p.returncode == 128 + signal.SIGTERM, out
    assert "checkpoint saved" in out, out
    c, _, all_runs = runs(project)
    (stopped,) = [r for r in all_runs if r.data.tags.get("stage") == "train"]
    assert stopped.info.status == "KILLED", out
    assert len(list((project / ".onegpu" / "checkpoints").glob("*/checkpoint-*"))) == 1, out

    resumed_out = run([str(BIN / "onegpu"), "train"], cwd=project).stdout
    assert "resuming from" in resumed_out, resumed_out
    params["train"].update(num_processes=1, per_device_train_batch_size=8)
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    run([str(BIN / "onegpu"), "train"], cwd=project)
    c, _, all_runs = runs(project)
    finished = sorted((r for r in all_runs if r.data.tags.get("stage") == "train" and r.info.status == "SCHEDULED"),
                      key=lambda r: r.info.start_time)
    assert len(finished) == 2
    resumed, reference = (_series(c, r.info.run_id, "loss") for r in finished)
    assert len(resumed) == len(reference) == steps
    assert resumed == pytest.approx(reference, rel=1e-5)


def test_a_rank_killed_outright_is_the_one_the_failed_run_names(tmp_path, prepared):
    """SIGKILL (as the kernel's out-of-memory killer sends it) to rank 1 mid-training: rank 0 then fails on
    the lost peer, but the run ends FAILED naming rank 1 and the signal, not rank 0's symptom."""
    import os
    import signal
    import subprocess

    import psutil

    from .conftest import _env
    project = prepared(tmp_path, TASKS["causal-lm"])
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["train"].update(num_processes=2, per_device_train_batch_size=4, gradient_accumulation_steps=1,
                           max_steps=40, learning_rate=1e-3, logging_steps=1)
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    p = subprocess.Popen([str(BIN / "onegpu"), "train"], cwd=project, env=_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in p.stdout:
        lines.append(line)
        if line.startswith("step 2/"):
            (rank1,) = [c for c in psutil.Process(p.pid).children(recursive=True)
                        if c.environ().get("RANK") == "1" and "onegpu" in " ".join(c.cmdline())]
            os.kill(rank1.pid, signal.SIGKILL)
            break
    out = "".join(lines) + p.communicate(timeout=300)[0]
    assert p.returncode == 2, out
    assert "training process rank 1 of 2 was killed by signal SIGKILL" in out, out
    _, _, all_runs = runs(project)
    (failed,) = [r for r in all_runs if r.data.tags.get("stage") == "train"]
    assert failed.info.status == "FAILED", out
    assert (failed.data.tags["error.rank"], failed.data.tags["error.exitcode"]) == ("1", "-9")
    assert "out-of-memory killer" in failed.data.tags["error.message"]
