"""onegpu.training.objectives.reinforcement: GRPO's objective. The group sampler draws each prompt num_generations
times in a row, in an order that depends on (seed, epoch) alone; a step's drawn rows become its prompts, sampled
once, cut into micro-batches of the drawn sizes whose counts are the completion tokens; the sampled completions
of the logging steps make the run's table; the reward functions go by TRL's names."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from onegpu.errors import ConfigError  # noqa: E402
from onegpu.training import objectives  # noqa: E402
from onegpu.training.objectives import reinforcement  # noqa: E402
from tests.unit.equivalence import float64  # noqa: E402

OBJECTIVE = objectives.get("grpo")


def test_the_group_sampler_repeats_each_prompt_in_a_row_seeded_per_epoch():
    sampler = reinforcement.GroupSampler(5, 3, seed=7)
    first = list(sampler)
    assert len(sampler) == len(first) == 15
    assert all(first[i] == first[i + 1] == first[i + 2] for i in range(0, 15, 3))
    assert sorted(first[::3]) == [0, 1, 2, 3, 4]
    sampler.set_epoch(1)
    second = list(sampler)
    assert second != first and sorted(second[::3]) == [0, 1, 2, 3, 4]
    again = reinforcement.GroupSampler(5, 3, seed=7)
    again.set_epoch(1)
    assert list(again) == second  # a resumed epoch draws the same order, whatever ran before


def test_the_rows_are_indices_and_collate_as_one_tensor():
    cfg, _ = float64.grpo_config({"per_device_train_batch_size": 4})
    rows = OBJECTIVE.model_inputs(float64.grpo_data(3))["train"]
    assert rows.column_names == ["row"] and rows["row"] == [0, 1, 2]
    assert OBJECTIVE.collator(None)([{"row": 2}, {"row": 0}])["row"].tolist() == [2, 0]
    assert OBJECTIVE.start_words(cfg) == ("completions", "training prompts (4 completions each an epoch)")
    assert OBJECTIVE.probes_activations is False


def test_a_steps_micro_batches_are_its_generations_cut_as_drawn_and_counted_by_completion_tokens():
    cfg, _ = float64.grpo_config({"per_device_train_batch_size": 3, "gradient_accumulation_steps": 4,
                                  "logging_steps": 2})
    model, _ = float64.grpo_model(cfg, 4)
    # 3 groups of 4 (prompts 1, 3, 0), micro-batches of 3 cutting across them
    drawn = [{"row": torch.tensor(r)} for r in ([1, 1, 1], [1, 3, 3], [3, 3, 0], [0, 0, 0])]
    batches = OBJECTIVE.step_batches(model, drawn, step=1)
    run = reinforcement.run_of(model)
    assert [int(b["input_ids"].shape[0]) for b in batches] == [3, 3, 3, 3]
    assert torch.equal(torch.cat([b["grpo_rows"] for b in batches]), torch.arange(12))
    tokens = sum(int(OBJECTIVE.count_batch(b)) for b in batches)
    assert tokens == int(run.batch.gens.completion_mask.sum()) == run.counts.tokens and run.counts.sequences == 12
    assert run.table["step"] == [1] * 12 and len(run.table["completion"]) == 12
    assert run.table["prompt"][::4] == [float64.grpo_data(4)["train"]["prompt"][i] for i in (1, 3, 0)]
    figures = OBJECTIVE.step_figures(model)()
    assert figures["completions/mean_length"] == tokens / 12 and "generation_seconds" in figures
    assert OBJECTIVE.step_figures(model)() == {}  # taken once
    OBJECTIVE.step_batches(model, drawn, step=3)  # not a logging step: no rows for the table
    assert len(run.table["step"]) == 12
    assert list(OBJECTIVE.run_tables(model)) == [reinforcement.COMPLETIONS_TABLE]


def test_a_step_of_rows_that_are_not_whole_groups_is_refused():
    cfg, _ = float64.grpo_config({"per_device_train_batch_size": 4})
    model, _ = float64.grpo_model(cfg, 2)
    with pytest.raises(RuntimeError, match="not whole groups of 4"):
        OBJECTIVE.step_batches(model, [{"row": torch.tensor([0, 0, 1, 1])}], step=1)


def test_the_same_step_samples_the_same_completions_and_another_step_others():
    cfg, _ = float64.grpo_config({"per_device_train_batch_size": 4})
    model, _ = float64.grpo_model(cfg, 2)
    drawn = [{"row": torch.tensor([0, 0, 0, 0])}]
    ids = [OBJECTIVE.step_batches(model, drawn, step=s)[0]["input_ids"] for s in (1, 1, 2)]
    assert torch.equal(ids[0], ids[1]) and not torch.equal(ids[0], ids[2])


def test_reward_functions_go_by_trls_names_and_a_bad_one_is_one_line():
    cfg, _ = float64.grpo_config({"per_device_train_batch_size": 4}, {"reward_funcs": ["correctness",
                                                                                     float64.TEXT_REWARD]})
    assert list(reinforcement.reward_funcs(cfg)) == ["correctness", "text_reward"]
    bad, _ = float64.grpo_config({"per_device_train_batch_size": 4}, {"reward_funcs": ["no_such_reward"]})
    with pytest.raises(ConfigError, match="train.grpo.reward_funcs: 'no_such_reward' is not a reward function"):
        reinforcement.reward_funcs(bad)


def test_a_model_built_elsewhere_has_no_grpo_state():
    with pytest.raises(RuntimeError, match="build it with onegpu.training.session.build_model"):
        reinforcement.run_of(torch.nn.Linear(2, 2))
