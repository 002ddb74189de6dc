"""Data-parallel training on a CPU (2 gloo processes under torch.distributed.run), read back from MLflow.

The causal LM's 2 processes x 4 x 1 and 1 x 8 x 1 are the same effective batch of 8: the same equivalence
key and, per optimizer step, the same loss and grad_norm within 1e-5 relative on both backends (the causal
LM pads each micro-batch to its own longest row, so the step's token count must be summed over the ranks
before normalising). This front-door run (`onegpu train` under torch.distributed.run) also asserts the
task-independent bookkeeping: one MLflow run per training, not one per rank; per-rank metrics beside the
whole step's; step counts summed over the ranks.

The classifier's two-process equality is proven more cheaply, not here: in float64 on the Trainer backend
(2 gloo ranks x 4 x 1 = 1 x 8 x 1, every gradient) by
tests/unit/equivalence/test_same_training_classifier.py::test_two_processes_are_one_in_float64_and_the_host_allocator_is_the_same_training,
and the Accelerate backend's classification step over two ranks by tests/unit/training/test_distributed.py.
"""
from __future__ import annotations

import pytest

from .conftest import BIN, run, runs, set_train

pytestmark = pytest.mark.slow

TASKS = {
    "causal-lm": {
        "data": {"max_train_samples": 32, "max_eval_samples": 16, "max_length": 48},
        "model": {"task": "causal-lm", "name_or_path": None, "n_layer": 2, "n_embd": 64, "n_head": 2,
                  "vocab_size": 512, "dropout": 0.0},
    },
}
# (processes, micro-batch, accumulation): the same effective batch of 8. One process's other splits
# (4 x 2, ...) are the same training by the accumulation tests (tests/unit/training/); here the
# reference is one process at 8 x 1 and each backend trains 2 processes x 4 x 1 against it.
REFERENCE = ("trainer", (1, 8, 1))
LAYOUTS = [("trainer", (2, 4, 1)), ("accelerate", (2, 4, 1)), REFERENCE]
STEPS = 3


def _train(project, backend: str, layout: tuple[int, int, int]) -> None:
    """`onegpu train` (the train stage's command) with this backend and layout in params.yaml."""
    procs, micro, accum = layout
    set_train(project, backend=backend, num_processes=procs, per_device_train_batch_size=micro,
              gradient_accumulation_steps=accum, max_steps=STEPS, learning_rate=1e-3)
    out = run([str(BIN / "onegpu"), "train"], cwd=project)
    if procs > 1:
        assert f"({micro} x {accum} x {procs} processes)" in out.stdout, out.stdout


def two_process_project(prepared, tmp_path, **train):
    """A prepared causal-LM copy whose params.yaml trains 2 processes x 4 x 1 (plus ``train``'s keys)."""
    project = prepared(tmp_path, TASKS["causal-lm"])
    set_train(project, num_processes=2, per_device_train_batch_size=4, gradient_accumulation_steps=1,
              learning_rate=1e-3, logging_steps=1, **train)
    return project


def train_and_act_at_step_2(project, act):
    """`onegpu train` in ``project``; ``act(process)`` once it prints step 2. Returns (process, output)
    after it ends (within 300 s).

    The rest of the output is read through the same reader: ``communicate(timeout=...)`` reads the raw
    pipe, and the lines this reader had already taken from it with step 2's (on a loaded machine, the
    steps after 2) were lost: the output then showed fewer steps than the run had logged."""
    import subprocess
    import threading

    from .conftest import _env
    p = subprocess.Popen([str(BIN / "onegpu"), "train"], cwd=project, env=_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in p.stdout:
        lines.append(line)
        if line.startswith("step 2/"):
            act(p)
            break
    rest = threading.Thread(target=lambda: lines.extend(p.stdout), daemon=True)
    rest.start()
    rest.join(timeout=300)
    assert not rest.is_alive(), "".join(lines) + "\n(the output did not end within 300 s)"
    p.wait(timeout=60)
    return p, "".join(lines)


def _series(client, run_id: str, key: str) -> list[float]:
    return [m.value for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)]


def test_two_processes_equal_one_process_per_step_for_the_causal_lm_on_both_backends(tmp_path, prepared):
    project = prepared(tmp_path, TASKS["causal-lm"])
    layouts = LAYOUTS
    for backend, layout in layouts:
        _train(project, backend, layout)
    c, _, all_runs = runs(project)
    train = [r for r in all_runs if r.data.tags.get("stage") == "train"]
    assert len(train) == len(layouts)  # one run per training, not one per process
    assert {r.info.status for r in train} == {"SCHEDULED"}
    assert len({r.data.tags["equivalence_key"] for r in train}) == 1
    by = {(r.data.params["train.backend"], int(r.data.params["resolved.world_size"]),
           int(r.data.params["resolved.per_device_train_batch_size"]),
           int(r.data.params["resolved.gradient_accumulation_steps"])): r for r in train}
    assert set(by) == {(b, *lay) for b, lay in layouts}
    assert {r.data.params["resolved.effective_batch_size"] for r in train} == {"8"}
    ref = by[(REFERENCE[0], *REFERENCE[1])].info.run_id
    for key in ("loss", "grad_norm"):
        expected = _series(c, ref, key)
        assert len(expected) == STEPS
        for name, r in by.items():
            got = _series(c, r.info.run_id, key)
            assert got == pytest.approx(expected, rel=1e-5), (key, name, got, expected)
    for backend in {b for b, (procs, _, _) in layouts if procs == 2}:
        two = by[(backend, 2, 4, 1)]
        m = two.data.metrics
        # The whole step's counts: 8 examples over both ranks; a per-rank breakdown beside them.
        assert _series(c, two.info.run_id, "step_examples") == [8.0] * STEPS
        assert m["mem_peak_bytes"] == max(m["mem_peak_bytes.rank0"], m["mem_peak_bytes.rank1"])
        assert m["step_tokens"] == _series(c, ref, "step_tokens")[-1]
        assert "samples_per_second.rank1" in m
