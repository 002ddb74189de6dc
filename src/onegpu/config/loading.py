"""Reading params.yaml: :func:`load` (the file and ``-S`` overrides), :func:`from_container` (OmegaConf's
structured merge, its errors in one line naming the key), then :func:`~onegpu.config.checks.validate`."""
from __future__ import annotations

import difflib
import math
import os
from dataclasses import fields

from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from onegpu.config.checks import validate
from onegpu.config.schema import SECTIONS, SUBSECTIONS, Config
from onegpu.errors import ConfigError


def _allowed_keys(section: str) -> list[str]:
    sub = SECTIONS.get(section) or SUBSECTIONS.get(section)
    return [f.name for f in fields(sub)] if sub else list(SECTIONS)


def _unknown_key_message(full_key: str) -> str:
    section, _, key = full_key.rpartition(".")
    allowed = _allowed_keys(section) if section else _allowed_keys("")
    hint = difflib.get_close_matches(key, allowed, n=1)
    did = f" Did you mean '{section + '.' if section else ''}{hint[0]}'?" if hint else ""
    where = f"'{section}'" if section else "the top level"
    return (f"unknown key '{full_key}'.{did} Allowed keys in {where}: {', '.join(allowed)}. "
            "(Keys come from params.yaml, e.g. after `dvc exp run -S +section.key=value`.)")


def load(path: str | os.PathLike = "params.yaml", overrides: list[str] | None = None) -> Config:
    """Read, type-check and validate a params file.

    Args:
        path: the YAML file (DVC's ``params.yaml``).
        overrides: DVC-style ``section.key=value`` items applied on top (``onegpu estimate -S``).
    Returns:
        A validated :class:`Config` (defaults filled for keys the file leaves out).
    Raises:
        ConfigError: the file is missing or not YAML, or a key is unknown, of a wrong type or out of
            range; the message names the key and what is allowed.
    """
    if not os.path.exists(path):
        raise ConfigError(f"{path} not found: run onegpu from the project root (where dvc.yaml is)")
    try:
        user = OmegaConf.load(path)
    except Exception as e:  # yaml.YAMLError and friends: report, never a traceback
        raise ConfigError(f"{path} is not valid YAML: {e}") from None
    if user is None or not OmegaConf.is_dict(user) or len(user) == 0:
        raise ConfigError(f"{path} must be a mapping with sections data, model, train, evaluate, tracking")
    raw = OmegaConf.to_container(user)
    for item in overrides or ():
        apply_override(raw, item)
    return from_container(raw, source=str(path) + (" with -S overrides" if overrides else ""))


def apply_override(raw: dict, item: str) -> None:
    """Apply one DVC-style ``-S section.key=value`` to ``raw`` in place, parsed by
    ``OmegaConf.from_dotlist`` (the value read as YAML; a value YAML cannot read stays a string, so the
    schema check names the key and the value).

    Raises:
        ConfigError: the item is not ``dotted.key=value``.
    """
    key, sep, value = item.partition("=")
    parts = key.strip().split(".")
    if not sep or len(parts) < 2 or not all(parts):
        raise ConfigError(f"-S {item!r}: expected section.key=value, e.g. train.gradient_accumulation_steps=4")
    try:
        override = OmegaConf.from_dotlist([f"{'.'.join(parts)}={value}"])
    except Exception:  # yaml's ParserError/ScannerError: keep the text for the type check to report
        override = OmegaConf.create()
        OmegaConf.update(override, ".".join(parts), value, force_add=True)
    merged = OmegaConf.to_container(OmegaConf.merge(OmegaConf.create(raw), override))
    raw.clear()
    raw.update(merged)


def from_container(raw: dict, source: str = "params") -> Config:
    """Validate a plain dict shaped like params.yaml (see :func:`load`)."""
    model = raw.get("model")
    lora = model.get("lora") if isinstance(model, dict) else None
    if lora is not None and not isinstance(lora, dict):  # OmegaConf's message for a list names no key
        raise ConfigError(f"{source}: model.lora: expected {_EXPECTED['LoraConfig | None']}, got {lora!r}")
    train = raw.get("train")
    if isinstance(train, dict) and train.get("eval_strategy") is False:
        train["eval_strategy"] = "no"  # HF's value, unquoted: YAML 1.1 (OmegaConf's, PyYAML's) reads `no` as false
    for name, kind in (("gradient_checkpointing_kwargs", "CheckpointingKwargs"), ("fsdp", "FSDPConfig")):
        value = train.get(name, {}) if isinstance(train, dict) else {}
        if not isinstance(value, dict):  # OmegaConf's message for a scalar in a mapping's place names no key
            raise ConfigError(f"{source}: train.{name}: expected {_EXPECTED[kind]}, got {value!r}")
    schema = OmegaConf.structured(Config)
    OmegaConf.set_struct(schema, True)
    try:
        merged = OmegaConf.merge(schema, raw)
    except ConfigKeyError as e:
        raise ConfigError(f"{source}: {_unknown_key_message(str(e.full_key))}") from None
    except ValidationError as e:
        if not e.full_key:  # a whole section given as a scalar or a list
            bad = [k for k, v in raw.items() if not isinstance(v, dict)]
            name = bad[0] if bad else "?"
            raise ConfigError(f"{source}: {name}: must be a mapping of keys ({', '.join(_allowed_keys(name))}), "
                              f"got {raw.get(name)!r}") from None
        raise ConfigError(f"{source}: {e.full_key}: {_type_message(e, e.full_key)}") from None
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", "") or ""
        raise ConfigError(f"{source}: {key}: {e.msg if hasattr(e, 'msg') else e}") from None
    cfg: Config = OmegaConf.to_object(merged)
    validate(cfg, source)
    return cfg


def _type_message(e: ValidationError, key: str) -> str:
    """What the schema expects at ``key`` (``section.name``) and what came, for a type error."""
    section, _, name = key.rpartition(".")
    schema = SECTIONS.get(section) or SUBSECTIONS.get(section)
    types = {f.name: str(f.type) for f in fields(schema)} if schema else {}
    expected = _EXPECTED.get(types.get(name, ""), types.get(name) or "a value")
    value = getattr(e, "value", None)
    if expected in ("a number", "a number or null", "an integer", "an integer or null") and _non_finite(value):
        # DVC's `-S key=.inf` (Hydra's override grammar) writes the *string* '.inf' into params.yaml.
        return f"must be finite (a number{' or null' if 'null' in expected else ''}), got {value!r}"
    return f"expected {expected}, got {value!r}"


# The schema's annotations (strings: this module uses postponed evaluation) in words.
_EXPECTED = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string",
             "int | None": "an integer or null", "float | None": "a number or null",
             "str | None": "a string or null", "list[str] | None": "a list of strings or null",
             "list[str]": "a list of strings", "list[float] | None": "a list of numbers or null",
             "bool | None": "true, false or null",
             "LoraConfig | None": "a mapping with keys r (0 = off), alpha, dropout, target_modules, or null (off)",
             "CheckpointingKwargs": ("a mapping with keys use_reentrant (true/false), every_n_layers "
                                     "(a positive integer)"),
             "DPOConfig": ("a mapping with keys beta, loss_type, loss_weights, label_smoothing, disable_dropout, "
                           "precompute_ref_log_probs"),
             "FSDPConfig": "a mapping with keys enabled (true/false), reshard_after_forward (true/false)"}


def _non_finite(value) -> bool:
    """True for a non-finite float or a string that spells one (``'.inf'``, ``'-Infinity'``, ``'nan'``)."""
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, str):
        word = value.strip().lower().lstrip("+-").lstrip(".")
        return word in ("inf", "infinity", "nan")
    return False
