"""onegpu.training.objectives.rewards: the built-in reward functions on both of TRL's completion forms, a
user's own by dotted path, and every bad name or return value one line."""
from __future__ import annotations

import pytest

from onegpu.errors import ConfigError
from onegpu.training.objectives import rewards


def test_correctness_reads_the_final_answer_as_a_number_or_as_text():
    completions = ["7 + 5 is 12", "<answer> 12 </answer> and then 13", "I think 13", "no idea",
                   "so the answer is 1,000", "Topic:\n  Business  "]
    answers = ["12", "12", "12", "12", "1000", "business"]
    assert rewards.correctness(prompts=[""] * 6, completions=completions, answer=answers) == [
        1.0, 1.0, 0.0, 0.0, 1.0, 1.0]


def test_answer_mentioned_finds_the_answer_as_a_word_anywhere():
    completions = ["This article is about a Sports show.", "sportsman of the year", "12 apples", "112", "",
                   [{"role": "assistant", "content": "it is tech, surely"}]]
    answers = ["sports", "sports", "12", "12", "tech", "tech"]
    assert rewards.answer_mentioned(prompts=[""] * 6, completions=completions, answer=answers) == [
        1.0, 0.0, 1.0, 0.0, 0.0, 1.0]


def test_conversational_completions_are_scored_by_their_content():
    conversational = [[{"role": "assistant", "content": "<think>5 + 7</think> 12"}],
                      [{"role": "assistant", "content": "12"}]]
    assert rewards.correctness(prompts=[[], []], completions=conversational, answer=[12, 12]) == [1.0, 1.0]
    assert rewards.think_format(prompts=[[], []], completions=conversational) == [1.0, 0.0]
    assert rewards.think_format(prompts=["", ""], completions=["<think>a</think> b", "b <think>a</think>"]) == [
        1.0, 0.0]


def test_a_users_function_by_dotted_path_and_the_built_in_names():
    assert rewards.resolve("correctness") is rewards.correctness
    assert rewards.resolve("onegpu.training.objectives.rewards:think_format") is rewards.think_format
    assert rewards.resolve("onegpu.training.objectives.rewards.final_answer") is rewards.final_answer


@pytest.mark.parametrize("name, words", [
    ("exactness", "is not a reward function; use one of correctness, answer_mentioned, think_format"),
    ("no_such_package.module:fn", "cannot be imported (ModuleNotFoundError"),
    ("onegpu.training.objectives.rewards:nothing", "cannot be imported (AttributeError"),
    ("onegpu.training.objectives.rewards:REWARDS", "is a dict, not a function"),
])
def test_a_bad_reward_name_is_one_line_naming_the_key(name, words):
    with pytest.raises(ConfigError) as e:
        rewards.resolve(name)
    assert str(e.value).startswith("train.grpo.reward_funcs: ") and words in str(e.value)
    assert "\n" not in str(e.value)


def test_score_calls_each_function_as_trl_does_and_checks_what_it_returns():
    seen = {}

    def length(prompts, completions, answer, **columns):
        seen.update(prompts=prompts, answer=answer, columns=sorted(columns))
        return [float(len(c)) if c else None for c in completions]
    got = rewards.score({"correctness": rewards.correctness, "length": length}, ["p", "p"], ["12", ""],
                        {"answer": ["12", "12"], "level": [1, 1]})
    assert got == {"correctness": [1.0, 0.0], "length": [2.0, None]}
    assert seen == {"prompts": ["p", "p"], "answer": ["12", "12"], "columns": ["level"]}
    with pytest.raises(ConfigError, match="'short' returned 1 value\\(s\\) for 2 completions"):
        rewards.score({"short": lambda prompts, completions, **c: [1.0]}, ["p", "p"], ["a", "b"], {})
    with pytest.raises(ConfigError, match="one float \\(or None\\) per completion"):
        rewards.score({"text": lambda prompts, completions, **c: ["yes", "no"]}, ["p", "p"], ["a", "b"], {})


def test_a_module_in_the_project_folder_is_found_as_a_stage_finds_it(tmp_path, monkeypatch):
    """The stages run in the project folder, from a console script whose sys.path starts at its bin folder."""
    import sys
    (tmp_path / "my_rewards_for_test.py").write_text("def short(prompts, completions, **kw):\n"
                                                     "    return [1.0 if len(c) < 5 else 0.0 for c in completions]\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    fn = rewards.resolve("my_rewards_for_test:short")
    assert fn(prompts=["", ""], completions=["ok", "too long"]) == [1.0, 0.0]
    sys.modules.pop("my_rewards_for_test", None)
