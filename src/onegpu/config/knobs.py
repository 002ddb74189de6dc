"""How a params.yaml key is declared: :func:`knob` (its default, help, rule and place in the equivalence key)
and the rules and reasons the sections share; :func:`fail`, the one-line error every check raises."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import MISSING, dataclass, field
from typing import Any

from onegpu.errors import ConfigError

# -- each params.yaml key declared once -----------------------------------------------------------------
# A key's field carries what every other place needs (TRL declares its config fields the same way, with
# ``metadata={"help": ...}``): its default, its help (params.yaml's comment on its line), its rule (the
# value is allowed, the problem otherwise), and whether it is in the equivalence key or why not. What is
# derived from them: :data:`RULES`, :data:`onegpu.equivalence.NOT_IN_EQUIVALENCE_KEY`, :func:`help_text`;
# params.yaml's comments are checked against the help (tests/unit/config/test_schema.py). Which stage reads a key
# is derived from the stages' code (tests/unit/test_dvc_yaml.py), not declared.

IN_KEY = "in the equivalence key"  # another value is another training
EACH_KEY = "each of its keys classified"  # a mapping (model.lora): its keys are declared and classified


@dataclass(frozen=True)
class OutOfKey:
    """A key left out of the equivalence key: runs that differ only in it compute the same training (or
    only observe it differently); ``why`` says how."""
    why: str


Rule = tuple[Callable[[Any], bool], str]  # (the value is allowed, the problem otherwise: ``{v}`` is the value)


def knob(default: Any = MISSING, *, help: str, key: str | OutOfKey, rule: Rule | None = None,
         default_factory: Callable[[], Any] | Any = MISSING):
    """A dataclass field for one params.yaml key: ``default`` (or ``default_factory``), ``help`` (one line,
    params.yaml's comment), ``key`` (:data:`IN_KEY` or an :class:`OutOfKey` with the reason) and ``rule``.

    Raises:
        TypeError: ``key`` is neither (every key is classified where it is declared).
    """
    if key not in (IN_KEY, EACH_KEY) and not isinstance(key, OutOfKey):
        raise TypeError(f"key must be IN_KEY, EACH_KEY (a mapping) or OutOfKey(why), got {key!r}")
    return field(default=default, default_factory=default_factory,
                 metadata={"help": help, "key": key, "rule": rule})


def positive(v) -> bool:
    return v >= 1


def positive_or_null(v) -> bool:
    return v is None or v >= 1


def fraction(v) -> bool:
    return 0.0 < v < 1.0


def seed(v) -> bool:
    return 0 <= v < 2**32


def one_of(choices: tuple[str, ...]) -> Rule:
    return (lambda v: v in choices), f"must be one of {', '.join(choices)}, got {{v!r}}"


def null_or_one_of(choices: tuple[str, ...], null: str) -> Rule:
    return (lambda v: v is None or v in choices), f"must be null ({null}) or one of {', '.join(choices)}, got {{v!r}}"


POSITIVE_INT: Rule = (positive, "must be a positive integer, got {v}")
SEED: Rule = (seed, "must be an integer from 0 to 2**32 - 1 (numpy's range), got {v}")
SHARE: Rule = (fraction, "must be a fraction strictly between 0 and 1, got {v}")
SPLIT = OutOfKey("how the effective batch is split (the effective batch is in)")
EVALUATION = OutOfKey("evaluation only")
CHOOSES = OutOfKey("which validation point counts as the best; the steps trained are the same")
VALIDATION = OutOfKey("when the validation split is evaluated; validation draws no random numbers and changes no "
                       "weight (proven bit-equal)")
SAME_RECOMPUTE = "; the same mathematics"
WHERE = OutOfKey("where the processes run, not what they compute")
SHARDED = ("the same mathematics, sharded: each process keeps 1/N of the weights, gradients and optimizer states "
            "and gathers the rest when a block needs it (the effective batch is in)")


def fail(source: str, key: str, problem: str) -> None:
    raise ConfigError(f"{source}: {key}: {problem}")
