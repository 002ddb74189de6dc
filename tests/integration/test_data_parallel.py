"""Data-parallel training on a CPU (2 gloo processes under torch.distributed.run), read back from MLflow.

The causal LM's 2 processes x 4 x 1 and 1 x 8 x 1 are the same effective batch of 8: the same equivalence
key and, per optimizer step, the same loss and grad_norm within 1e-12 relative in float64 from start-up on
both backends (the causal LM pads each micro-batch to its own longest row, so the step's token count must be
summed over the ranks before normalising). The one process is ``float64_reference`` (tests/integration/conftest.py),
trained once per session for every data-parallel file. This front-door run (`onegpu train` under
torch.distributed.run) also asserts the task-independent bookkeeping: one MLflow run per training, not one per
rank; per-rank metrics beside the whole step's; step counts summed over the ranks.

The classifier's two-process equality is proven more cheaply, not here: in float64 on the Trainer backend
(2 gloo ranks x 4 x 1 = 1 x 8 x 1, every gradient) by
tests/unit/equivalence/test_same_training_classifier.py::test_two_processes_are_one_in_float64_and_the_host_allocator_is_the_same_training,
and the Accelerate backend's classification step over two ranks by tests/unit/training/parallel/test_distributed.py.
"""
from __future__ import annotations

import pytest

from .conftest import (
    BIN,
    CAUSAL_LM,
    SPLIT_REFERENCE,
    assert_reference_steps,
    float64_env,
    run,
    runs,
    series,
    set_train,
)

pytestmark = pytest.mark.slow

STEPS = SPLIT_REFERENCE["max_steps"]


def two_process_project(prepared, tmp_path, **train):
    """A prepared causal-LM copy whose params.yaml trains 2 processes x 4 x 1 (plus ``train``'s keys)."""
    project = prepared(tmp_path, CAUSAL_LM)
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


def test_two_processes_equal_one_process_per_step_for_the_causal_lm_on_both_backends(tmp_path, prepared,
                                                                                      float64_reference):
    ref = float64_reference()
    project = two_process_project(prepared, tmp_path, max_steps=STEPS)
    for backend in ("trainer", "accelerate"):
        set_train(project, backend=backend)
        out = run([str(BIN / "onegpu"), "train"], cwd=project, env=float64_env()).stdout
        assert "(4 x 1 x 2 processes)" in out, out
    c, _, all_runs = runs(project)
    train = [r for r in all_runs if r.data.tags.get("stage") == "train"]
    assert len(train) == 2  # one run per training, not one per process
    assert {r.info.status for r in train} == {"SCHEDULED"}
    assert {r.data.tags["equivalence_key"] for r in train} == {ref["equivalence_key"]}
    by = {r.data.params["train.backend"]: r for r in train}
    assert set(by) == {"trainer", "accelerate"}
    for r in train:
        assert [r.data.params[f"resolved.{k}"] for k in ("world_size", "per_device_train_batch_size",
                                                          "gradient_accumulation_steps", "effective_batch_size")
                ] == ["2", "4", "1", "8"]
        assert_reference_steps(c, r, ref)
        m = r.data.metrics
        # The whole step's counts: 8 examples over both ranks; a per-rank breakdown beside them.
        assert series(c, r.info.run_id, "step_examples") == [8.0] * STEPS
        assert m["mem_peak_bytes"] == max(m["mem_peak_bytes.rank0"], m["mem_peak_bytes.rank1"])
        assert m["step_tokens"] == ref["step_tokens"][-1]
        assert "samples_per_second.rank1" in m
