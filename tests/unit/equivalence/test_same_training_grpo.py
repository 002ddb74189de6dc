"""GRPO is the same training however its steps are split (issue 63): the step's completions sampled once (seeded
by the step), their advantages over whole groups, then cut into micro-batches; on the hidden-32 Llama of the
packaged tokenizer's vocabulary, the fused LM head, both backends, in float64.

- 8 x 1 = 2 x 4 = 1 x 8 (4 completions a prompt, 2 prompts a step) within 1e-12 at every step for ``dapo``,
  ``dr_grpo`` and ``grpo`` (loss, grad_norm, every parameter's step-1 gradient and TRL's per-step figures).
"""
from __future__ import annotations

import functools

import pytest

torch = pytest.importorskip("torch")

from tests.unit.equivalence import float64  # noqa: E402

FIGURES = ("reward", "reward_std", "rewards/text_reward/mean", "completions/mean_length",
           "completions/clipped_ratio", "clip_ratio/region_mean")


@functools.cache
def baseline(loss_type: str = "dapo") -> float64.Run:
    return float64.grpo_run(8, 1, grpo={"loss_type": loss_type})


def assert_same(a: float64.Run, b: float64.Run) -> None:
    """grad_norm and every parameter's step-1 gradient within 1e-12 relative (:func:`float64.distance`), the loss
    within 1e-12 relative or, where it is rounding around 0, 1e-15 absolute (``grpo``'s loss at
    ``num_iterations`` 1 is minus the mean of the advantages, exactly 0: a group's sum to 0), and TRL's figures
    within 1e-12."""
    assert [r["step"] for r in a.rows] == [r["step"] for r in b.rows] and len(a.rows) >= 2
    assert [r["targets"] for r in a.rows] == [r["targets"] for r in b.rows]
    d = float64.distance(a, b)
    assert max(d["grad_norm"], d["gradient"]) <= float64.REL, d
    for r, s in zip(a.rows, b.rows):
        assert abs(r["loss"] - s["loss"]) <= max(float64.REL * abs(s["loss"]), 1e-15), (r["loss"], s["loss"])
        assert all(abs(r[k] - s[k]) <= 1e-12 * max(1.0, abs(s[k])) for k in FIGURES), (r, s)


def test_a_step_samples_its_groups_and_trains_on_their_advantages():
    rows = baseline().rows
    assert [r["step"] for r in rows] == [1, 2] and all(r["samples"] == 8 for r in rows)
    assert all(r["reward_std"] > 0 and r["grad_norm"] > 0 and abs(r["loss"]) > 1e-3 for r in rows)
    assert all(r["completions/min_length"] < r["completions/max_length"] for r in rows)  # uneven lengths
    assert all(r["targets"] == r["completions/mean_length"] * 8 for r in rows)  # the completion tokens


@pytest.mark.parametrize("loss_type", ["dapo", "dr_grpo", "grpo"])
@pytest.mark.parametrize("split", [dict(micro=2, accum=4), dict(micro=1, accum=8, backend="accelerate")],
                         ids=["2x4", "1x8-accelerate"])
def test_the_splits_of_a_step_are_one_training_in_float64(split, loss_type):
    assert_same(float64.grpo_run(**split, grpo={"loss_type": loss_type}), baseline(loss_type))


@pytest.mark.parametrize("backend", ["trainer", "accelerate"])
def test_an_out_of_memory_retry_is_the_same_step_figures_included(backend):
    """An injected out-of-memory error in step 1's second micro-batch (4 x 2): the step is redone in pieces of 2
    completions, on the generations already sampled (no new sampling), and is the step without the error, its
    figures counted once."""
    calls = []

    def injector(step: int, rows: int) -> bool:
        calls.append((step, rows))
        return len(calls) == 2
    run = float64.grpo_run(4, 2, steps=1, backend=backend, oom_injector=injector)
    assert (1, 2) in calls  # the retry ran in pieces of 2 completions
    whole = float64.grpo_run(4, 2, steps=1, backend=backend)
    assert [r["targets"] for r in run.rows] == [r["targets"] for r in whole.rows]
    d = float64.distance(run, whole)
    assert max(d["grad_norm"], d["gradient"]) <= float64.REL, d
    for k in ("loss", *FIGURES):
        assert abs(run.rows[0][k] - whole.rows[0][k]) <= 1e-12 * max(1.0, abs(whole.rows[0][k])), k


def test_bnpo_moves_with_the_split_by_a_measured_amount():
    """TRL's bnpo (each micro-batch's token mean, averaged over the micro-batches) is dapo in one micro-batch and
    another loss once the step is split (its docs say so): 2 x 4 moves its step-1 gradient by more than 1%."""
    whole, split = baseline("bnpo"), float64.grpo_run(2, 4, grpo={"loss_type": "bnpo"})
    assert float64.distance(whole, baseline("dapo"))["gradient"] <= float64.REL
    moved = float64.distance(split, whole)
    assert moved["gradient"] > 1e-2, moved
    print(f"bnpo, 2 x 4 against 8 x 1: step-1 gradient {moved['gradient']:.3g} apart (relative), grad_norm "
          f"{moved['grad_norm']:.3g}")


def test_the_splits_agree_in_float32_within_1e_6_at_step_1_and_1e_5_later():
    a, b = float64.grpo_run(8, 1, dtype=torch.float32), float64.grpo_run(1, 8, backend="accelerate",
                                                                         dtype=torch.float32)
    assert [r["targets"] for r in a.rows] == [r["targets"] for r in b.rows]
    for i, (r, s) in enumerate(zip(a.rows, b.rows)):
        assert abs(r["grad_norm"] - s["grad_norm"]) <= (1e-6 if i == 0 else 1e-5) * abs(s["grad_norm"]), (i, r, s)
        assert abs(r["loss"] - s["loss"]) <= (1e-6 if i == 0 else 1e-5) * max(abs(s["loss"]), 1e-3), (i, r, s)


@pytest.mark.parametrize("backend", ["trainer", "accelerate"])
def test_a_stopped_and_resumed_run_is_the_uninterrupted_one(tmp_path, monkeypatch, backend):
    """Stopped during step 2 of 4 (6 prompts: 3 steps an epoch, so step 4 is the next epoch's) and resumed from
    its checkpoint: steps 3 and 4 sample the same completions and train the same (loss, grad_norm and TRL's figures
    within 1e-12 in float64), and the completions table holds every step's rows once, as the uninterrupted run's."""
    import importlib

    from onegpu.training.backends import base
    from tests.unit import tiny
    monkeypatch.chdir(tmp_path)
    cfg, _ = float64.grpo_config({"backend": backend, "per_device_train_batch_size": 4,
                                  "gradient_accumulation_steps": 2, "max_steps": 4, "optim": "sgd",
                                  "max_grad_norm": 0.0, "seed": 3, "logging_steps": 1})
    module = importlib.import_module(base.REGISTRY[backend])

    def run(sink, **kw):
        model, data = float64.grpo_model(cfg, 6)
        with float64.float64_throughout(model):
            return module.train(base.TrainRequest(model, float64.chat_tokenizer(), data, cfg, sink, **kw))
    whole = []
    _, whole_steps = run(lambda m, s: whole.append(m))
    _, resume = tiny.interrupt_at_step_2(run, tmp_path / "ckpt")
    assert resume is not None and resume.step == 2
    rest = []
    _, rest_steps = run(lambda m, s: rest.append(m), checkpoint_dir=tmp_path / "ckpt", resume=resume)
    assert len(whole) == 4 and len(rest) == 2
    # the completions table: the stopped run's steps kept in the checkpoint, the resumed steps' the same samples
    [(name, table)] = rest_steps.tables.items()
    assert table == whole_steps.tables[name] and table["step"] == [s for s in range(1, 5) for _ in range(8)]
    for r, s in zip(rest, whole[2:]):
        for k in ("loss", "grad_norm", *FIGURES):
            assert abs(r[k] - s[k]) <= 1e-12 * max(1.0, abs(s[k])), (k, r[k], s[k])


@pytest.mark.slow  # the packaged model: make test-all
@pytest.mark.big_memory
def test_on_the_packaged_chat_model_a_grpo_step_split_is_exact_in_float64():
    """The packaged SmolLM2-135M-Instruct itself, one step of one prompt's 4 completions (sampled from it in the
    step), 4 x 1 on the Trainer against 2 x 2 on the Accelerate loop: loss, grad_norm and every parameter's
    gradient within 1e-12 (the loss, rounding around 0 or not, within 1e-15 absolute)."""
    whole = float64.grpo_run(4, 1, prompts=1, steps=1, packaged=True)
    split = float64.grpo_run(2, 2, prompts=1, steps=1, packaged=True, backend="accelerate")
    assert whole.rows[0]["grad_norm"] > 0
    assert [r["targets"] for r in split.rows] == [r["targets"] for r in whole.rows]
    d = float64.distance(split, whole)
    assert max(d["grad_norm"], d["gradient"]) <= float64.REL, d
    assert abs(split.rows[0]["loss"] - whole.rows[0]["loss"]) <= max(float64.REL * abs(whole.rows[0]["loss"]), 1e-15)
