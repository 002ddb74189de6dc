"""GRPO's reward functions: named Python callables with TRL's signature, so a function written for TRL's
``GRPOTrainer`` is one here too:

    fn(prompts: list, completions: list, **columns) -> list[float | None]

``completions`` are strings (TRL's standard form) or one-message lists of ``{"role", "content"}`` dicts
(its conversational form); ``columns`` are the dataset's other columns, one value per completion (e.g.
``answer``); None is "cannot score this one" (TRL leaves it out of the group's mean). Built in:
``correctness`` (the completion's final answer against the row's ``answer``), ``answer_mentioned`` (the
answer anywhere in it: partial credit) and ``think_format`` (TRL's ``trl.rewards.think_format_reward``); a
user's own by dotted path (``package.module:function`` or ``package.module.function``: an installed package or a
module in the project folder), resolved before any work (:func:`resolve`).
"""
from __future__ import annotations

import os
import pkgutil
import re
import sys
from collections.abc import Callable

from onegpu.data.chat import last_text
from onegpu.errors import ConfigError

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?")


def final_answer(completion: str, numeric: bool) -> str:
    """What a completion answers: the last ``<answer>...</answer>`` if there is one, else (``numeric``) its
    last number, else its last non-empty line; stripped. Empty when there is none."""
    tagged = _ANSWER_TAG.findall(completion)
    if tagged:
        return tagged[-1].strip()
    if numeric:
        numbers = _NUMBER.findall(completion)
        return numbers[-1] if numbers else ""
    lines = [line.strip() for line in completion.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _number(s: str) -> float | None:
    try:
        return float(s.replace(",", ""))
    except ValueError:
        return None


def _same(got: str, want: str) -> bool:
    """Numbers by value (``1,000`` = ``1000.0``), text case- and whitespace-insensitively."""
    a, b = _number(got), _number(want)
    if a is not None and b is not None:
        return a == b
    return " ".join(got.split()).casefold() == " ".join(want.split()).casefold()


def correctness(prompts, completions, answer, **columns) -> list[float]:
    """1.0 where the completion's :func:`final_answer` is the row's ``answer`` (a number compared by value,
    text case- and whitespace-insensitively), else 0.0."""
    out = []
    for completion, want in zip(completions, answer):
        want = str(want).strip()
        got = final_answer(last_text(completion), _number(want) is not None)
        out.append(1.0 if got and _same(got, want) else 0.0)
    return out


def answer_mentioned(prompts, completions, answer, **columns) -> list[float]:
    """Partial credit: 1.0 where the row's ``answer`` appears in the completion as a whole word or number
    (case-insensitive), wherever it is, else 0.0. Lenient by design (a completion naming every candidate
    passes it): a signal for a small model that names the answer in a sentence before it learns the format
    :func:`correctness` checks; the held-out pass rate stays :func:`correctness`'s."""
    out = []
    for completion, want in zip(completions, answer):
        want = " ".join(str(want).split())
        found = bool(want) and re.search(rf"(?<!\w){re.escape(want)}(?!\w)", last_text(completion), re.IGNORECASE)
        out.append(1.0 if found else 0.0)
    return out


def think_format(prompts, completions, **columns) -> list[float]:
    """TRL's ``think_format_reward``: 1.0 where the completion opens with one ``<think>...</think>`` block."""
    from trl.rewards import think_format_reward
    return think_format_reward([[{"content": last_text(c)}] for c in completions])


REWARDS: dict[str, Callable] = {"correctness": correctness, "answer_mentioned": answer_mentioned,
                                "think_format": think_format}


def resolve(name: str, key: str = "train.grpo.reward_funcs") -> Callable:
    """The reward function ``name`` names: a built-in one (:data:`REWARDS`) or a user's by dotted path.

    Raises:
        ConfigError: one line naming ``key``, the name, what went wrong and what is allowed.
    """
    if name in REWARDS:
        return REWARDS[name]
    allowed = f"use one of {', '.join(REWARDS)} or a dotted path to your function (package.module:function)"
    if "." not in name.strip(".:") and ":" not in name.strip(".:"):
        raise ConfigError(f"{key}: {name!r} is not a reward function; {allowed}")
    if os.getcwd() not in sys.path:  # a module in the project folder (the stages run there; a console script's
        sys.path.append(os.getcwd())  # sys.path starts at its bin folder)
    try:
        fn = pkgutil.resolve_name(name)  # both forms, package.module:function and package.module.function
    except ValueError:
        raise ConfigError(f"{key}: {name!r} is not a reward function; {allowed}") from None
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"{key}: {name!r} cannot be imported ({type(e).__name__}: {e}); {allowed}") from None
    if not callable(fn):
        raise ConfigError(f"{key}: {name!r} is a {type(fn).__name__}, not a function; {allowed}")
    return fn


def score(funcs: dict[str, Callable], prompts: list, completions: list, columns: dict[str, list]):
    """Each reward function's scores of the completions, as TRL calls them.

    Args:
        funcs: name -> function (:func:`resolve`'s), in the order their rewards are reported.
        prompts, completions: one entry per completion (a prompt repeated for each of its completions).
        columns: the rows' other columns, one value per completion.
    Returns:
        name -> list of float or None, one per completion.
    Raises:
        ConfigError: a function returned another number of scores, or a score that is not a number or None.
    """
    out = {}
    for name, fn in funcs.items():
        got = list(fn(prompts=prompts, completions=completions, **columns))
        if len(got) != len(completions) or not all(s is None or isinstance(s, (int, float)) for s in got):
            raise ConfigError(f"reward function {name!r} returned {len(got)} value(s) for {len(completions)} "
                              "completions; it must return one float (or None) per completion")
        out[name] = [None if s is None else float(s) for s in got]
    return out
