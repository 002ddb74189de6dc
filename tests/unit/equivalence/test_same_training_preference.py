"""DPO is the same training however its steps are split (issue 42): on a 2-layer model of SmolLM2-135M's width and
vocabulary (make test-all) and on its narrow twin (make test) with the packaged tokenizer's chat template, 8 pairs
per step whose answers differ in length, the fused LM head, both backends.

- Step 1 with policy = reference and dropout off: loss ln 2 (float64 exactly; float32 within 1e-7).
- 8 x 1 = 2 x 4 = 1 x 8 = padding-free, and a 7-pair step as 4 + 3, in float64 within 1e-12 at every step
  (loss, grad_norm, every parameter's step-1 gradient), Trainer and Accelerate; in float32 within 1e-6 at
  step 1 and 1e-5 later.
"""
from __future__ import annotations

import functools
import math

import pytest

torch = pytest.importorskip("torch")

from tests.unit.equivalence import float64  # noqa: E402

FIGURES = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/ties", "rewards/margins",
           "logps/chosen", "logps/rejected")


def baseline(dtype=torch.float64) -> float64.Run:
    """8 x 1 on the from-config model of the current shape (``from_config_shape``), kept for the file's tests."""
    return _baseline_of(float64.current_shape(), dtype)


@functools.cache
def _baseline_of(shape: str, dtype) -> float64.Run:
    return float64.dpo_run(8, 1, dtype=dtype)


def assert_same(a: float64.Run, b: float64.Run, figures=FIGURES) -> None:
    """:func:`float64.assert_same`, and TRL's ``figures`` of every step within 1e-12 (absolute: rewards are 0 at
    step 1)."""
    float64.assert_same(a, b)
    for r, s in zip(a.rows, b.rows):
        assert all(abs(r[k] - s[k]) <= 1e-12 * max(1.0, abs(s[k])) for k in figures), (r, s)


@pytest.mark.usefixtures("from_config_shape")  # the narrow twin (make test), SmolLM2's width (make test-all)
def test_step_1_of_a_policy_that_is_its_reference_is_ln2():
    first = baseline().rows[0]
    assert first["loss"] == math.log(2)
    assert abs(baseline(torch.float32).rows[0]["loss"] - math.log(2)) <= 1e-7
    assert [first[k] for k in FIGURES[:5]] == [0.0, 0.0, 0.0, 1.0, 0.0]  # every pair a tie
    later = baseline().rows[1]
    assert 0 < later["rewards/accuracies"] + later["rewards/ties"] <= 1 and later["rewards/ties"] < 1


@pytest.mark.usefixtures("from_config_shape")  # the narrow twin (make test), SmolLM2's width (make test-all)
@pytest.mark.parametrize("split", [dict(micro=2, accum=4), dict(micro=1, accum=8, backend="accelerate"),
                                   dict(micro=4, accum=2, backend="accelerate", padding_free=True),
                                   dict(micro=8, padding_free=True)], ids=["2x4", "1x8-accelerate",
                                                                           "4x2-accelerate-padding-free",
                                                                           "8x1-padding-free"])
def test_the_splits_of_a_step_are_one_training_in_float64(split):
    assert_same(float64.dpo_run(**split), baseline())


@pytest.mark.usefixtures("from_config_shape")  # the narrow twin (make test), SmolLM2's width (make test-all)
def test_a_precomputed_reference_is_the_live_one_over_a_whole_run_in_float64():
    """train.dpo.precompute_ref_log_probs: the reference's log-probabilities computed once before step 1 (in
    batches of their own) and read from the rows, no reference model kept: the live frozen copy's steps. Not
    its ties: at step 1 a reward of 1.8e-16 (rounding) is no tie, so rewards/accuracies counts it."""
    run = float64.dpo_run(2, 4, backend="accelerate", dpo={"precompute_ref_log_probs": True})
    assert_same(run, baseline(), [k for k in FIGURES if k not in ("rewards/accuracies", "rewards/ties")])
    assert [r["rewards/accuracies"] for r in run.rows[1:]] == [r["rewards/accuracies"] for r in baseline().rows[1:]]
    assert 0 < run.rows[0]["rewards/accuracies"] + run.rows[0]["rewards/ties"] <= 1


@pytest.mark.usefixtures("from_config_shape")  # the narrow twin (make test), SmolLM2's width (make test-all)
@pytest.mark.parametrize("backend,padding_free", [("trainer", True), ("accelerate", False)])
def test_an_out_of_memory_retry_is_the_same_training_rewards_included(backend, padding_free):
    """An injected out-of-memory error in step 1's second micro-batch (4 x 2): the step is redone in pieces of
    2 pairs, and is the step without the error, its rewards/* counted once (the retried micro-batches' figures
    were added to the failed attempt's). Padding-free with a precomputed reference, whose per-sequence
    log-probabilities the cut must carry; its step-1 rewards are rounding (1e-16) whose sign the pieces'
    summation order changes, so its ties and accuracies are not compared (as in
    test_a_precomputed_reference_is_the_live_one_over_a_whole_run_in_float64)."""
    calls = []

    def injector(step: int, sequences: int) -> bool:
        calls.append((step, sequences))
        return len(calls) == 2
    kw = dict(backend=backend, padding_free=padding_free, steps=1,
              dpo={"precompute_ref_log_probs": True} if padding_free else None)
    run = float64.dpo_run(4, 2, oom_injector=injector, **kw)
    assert (1, 4) in calls  # the retry ran in pieces of 2 pairs (4 sequences)
    whole = float64.dpo_run(4, 2, **kw)
    float64.assert_same(run, whole, steps=1)
    ref = whole.rows[0]
    for k in FIGURES if not padding_free else FIGURES[:2] + FIGURES[4:]:
        assert abs(run.rows[0][k] - ref[k]) <= 1e-12 * max(1.0, abs(ref[k])), (k, run.rows[0][k], ref[k])


@pytest.mark.usefixtures("from_config_shape")  # the narrow twin (make test), SmolLM2's width (make test-all)
@pytest.mark.parametrize("backend", ["trainer", "accelerate"])
def test_a_step_of_7_pairs_as_4_plus_3_is_the_7_pair_step_in_float64(backend):
    """7 pairs of data, 2 epochs: each step is the epoch's 7 pairs, as 7 x 1 or as 4 + 3 (TRL would weigh
    the 3 pairs' mean like the 4's: tests/unit/training/objectives/test_dpo.py shows by how much)."""
    whole = float64.dpo_run(7, 1, pairs=7, rows=7, backend=backend)
    assert_same(float64.dpo_run(4, 2, pairs=7, rows=7, backend=backend), whole)
    assert [r["loss"] for r in whole.rows][0] == math.log(2) and whole.rows[1]["loss"] != math.log(2)


@pytest.mark.usefixtures("from_config_shape")  # the narrow twin (make test), SmolLM2's width (make test-all)
def test_the_splits_agree_in_float32_within_1e_6_at_step_1_and_1e_5_later():
    a, b = baseline(torch.float32), float64.dpo_run(1, 8, backend="accelerate", dtype=torch.float32)
    for i, (r, s) in enumerate(zip(a.rows, b.rows)):
        for k in ("loss", "grad_norm"):
            assert abs(r[k] - s[k]) <= (1e-6 if i == 0 else 1e-5) * abs(s[k]), (i, k, r[k], s[k])


@pytest.mark.parametrize("backend", ["trainer", "accelerate"])
def test_a_stopped_and_resumed_run_is_the_uninterrupted_one(tmp_path, monkeypatch, backend):
    """Stopped during step 2 and resumed from its checkpoint: steps 3 and 4 as in one run (loss, grad_norm and
    rewards/* within 1e-12 in float64); the resumed run's reference is the model it started from, not the
    checkpoint's weights (a policy equal to its reference would give ln 2 again at step 3)."""
    import importlib

    from onegpu.config import from_container
    from onegpu.training import objectives
    from onegpu.training.backends import base
    from onegpu.training.objectives import lm_head
    from tests.unit import tiny
    from tests.unit.training.objectives.test_batches import tiny_llama
    monkeypatch.chdir(tmp_path)
    train = {"backend": backend, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2, "max_steps": 4,
             "optim": "sgd", "learning_rate": 1e-2, "max_grad_norm": 0.0, "seed": 3}
    cfg = from_container({"model": dict(float64.PREFERENCE), "data": {"source": "pairs.jsonl"}, "train": train},
                         source="test")
    module = importlib.import_module(base.REGISTRY[backend])

    def run(sink, **kw):
        model = tiny_llama()  # (a narrow model: resuming is about the loop, not the output layer's width)
        lm_head.attach(model)
        model = model.double()
        float64.float64_norms(model)
        objectives.get("preference").prepare_model(model, cfg)
        with float64.float64_throughout(model):
            return module.train(base.TrainRequest(model, float64.chat_tokenizer(), float64.preference_data(16), cfg,
                                                  sink, **kw))
    whole = []
    run(lambda m, s: whole.append(m))
    first, resume = tiny.interrupt_at_step_2(run, tmp_path / "ckpt")
    assert resume is not None and resume.step == 2
    rest = []
    run(lambda m, s: rest.append(m), checkpoint_dir=tmp_path / "ckpt", resume=resume)
    assert len(rest) == 2 and rest[0]["loss"] != math.log(2)
    for r, s in zip(rest, whole[2:]):
        for k in ("loss", "grad_norm", *FIGURES):
            assert abs(r[k] - s[k]) <= 1e-12 * max(1.0, abs(s[k])), (k, r[k], s[k])


@pytest.mark.slow  # the packaged model: make test-all
@pytest.mark.big_memory
def test_on_the_packaged_chat_model_a_dpo_step_split_is_exact_in_float64():
    """The packaged SmolLM2-135M-Instruct itself, 4 pairs in one step (the whole 30-layer model in float64
    costs the suite in proportion to its rows: test_same_training_packaged.py), 4 x 1 on the Trainer against
    2 x 2 padding-free on the Accelerate loop: loss, grad_norm and every parameter's gradient within 1e-12."""
    whole = float64.dpo_run(4, 1, pairs=4, steps=1, packaged=True)
    split = float64.dpo_run(2, 2, pairs=4, steps=1, packaged=True, backend="accelerate", padding_free=True)
    assert whole.rows[0]["loss"] == math.log(2)
    float64.assert_same(split, whole, steps=1)


# -- train.fsdp: DPO over 2 gloo processes, the policy sharded (the whole logits and the fused head, whose tiles
# project with the root's gathered head after the forward), against one unsharded process of the whole logits; on a
# hidden-32 Llama of the tokenizer's vocabulary (the 2-layer SmolLM2 shape's 49,152 x 576 float64 embedding,
# gathered every forward over gloo, took 75 s) --

# (micro-batch of each process, accumulation, dpo_run's keys) of each case: 2 x 1 x 2 = 4 pairs a step.
FSDP_CASES = {"frozen-copy": (1, 2, {}),  # the reference sharded as the policy is
              "lora": (1, 2, {"lora": True}),  # the reference: the sharded policy, its adapter disabled
              "frozen-copy-fused": (1, 2, {"fused": True}),  # both heads fused, the reference's resharded after
              "lora-fused": (1, 2, {"lora": True, "fused": True})}
# (A precomputed reference keeps no model: its sharded run is the policy's alone, as in the SFT proofs.)
SHARDED = {"backend": "accelerate", "num_processes": 2, "eval_strategy": "no", "oom_retry": False,
           "fsdp": {"enabled": True}}


@functools.cache
def whole_logits(lora: bool = False) -> float64.Run:
    return float64.dpo_run(4, 1, pairs=4, fused=False, lora=lora, tiny=True)


def _fsdp_rank(rank: int, port: int, out: str) -> None:
    import os
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from accelerate.state import AcceleratorState, GradientState

    from onegpu.training.parallel import distributed
    distributed.TIMEOUT_S = 60
    runs = {}
    for case, (micro, accum, extra) in FSDP_CASES.items():
        fused = extra.get("fused", False)
        run = float64.dpo_run(micro, accum, pairs=4, tiny=True, **{"fused": False, **extra}, **SHARDED,
                              fused_lm_head=fused)
        runs[case] = (run.rows, run.grads)
        AcceleratorState._reset_state(reset_partial_state=False)  # (the process group stays)
        GradientState._reset_state()
    torch.save(runs, f"{out}/rank{rank}.pt")


@pytest.mark.slow  # two spawned processes: make test-all
def test_dpo_sharded_over_two_processes_is_one_process_in_float64(tmp_path):
    """train.fsdp with DPO: 2 gloo processes x 1 x 2 pairs, the policy sharded, = 1 unsharded process x 4 x 1 of
    the whole logits, per step within 1e-12 in float64 (loss, grad_norm, every parameter's step-1 gradient gathered
    whole, TRL's figures all-reduced over the step's 4 pairs): the frozen reference copy sharded as the policy, and
    LoRA's disabled adapter; each with the whole logits and with the fused LM head (policy and reference)."""
    import torch.multiprocessing as mp

    from tests.unit.training.parallel.test_distributed import _free_port
    mp.spawn(_fsdp_rank, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)
    for r in (0, 1):
        for case, (rows, grads) in torch.load(tmp_path / f"rank{r}.pt", weights_only=False).items():
            run, ref = float64.Run(rows, grads), whole_logits(lora=FSDP_CASES[case][2].get("lora", False))
            print(f"fsdp dpo {case}, rank {r}: {float64.distance(run, ref)}")
            assert_same(run, ref)
