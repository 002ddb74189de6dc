"""onegpu.config.schema: every key declared once, with its help, rule and place in the equivalence key, as
params.yaml holds it."""
from __future__ import annotations

import re

from onegpu import config
from tests import defaults


def test_every_rule_names_a_schema_key():
    schema = set(config.flatten(config.Config().to_dict()))
    assert set(config.RULES) <= schema
    assert set(config.COMBINATIONS) <= set(config.SECTIONS)


# -- each key declared once (config.knob) ----------------------------------------------------------

def _every_key() -> list[str]:
    """Every leaf of params.yaml's schema, the mappings filled (``model.lora`` is null by default)."""
    cfg = config.Config(model=config.ModelConfig(lora=config.LoraConfig()))
    return list(config.flatten(cfg.to_dict()))


def test_every_key_is_declared_in_or_out_of_the_equivalence_key_with_help():
    """Every data.*, model.*, train.*, evaluate.* and tracking.* key is a knob: in the key, or out of it with
    a reason; a mapping's own field says its keys are classified; every one has a line of help."""
    declared = config.declarations()
    assert list(declared) == _every_key()
    for key, f in declared.items():
        assert f.metadata["key"] == config.IN_KEY or f.metadata["key"].why.strip(), key
        assert f.metadata["help"].strip() and "\n" not in f.metadata["help"], key
    mappings = {k: f for k, f in config.declarations(leaves=False).items() if k not in declared}
    assert sorted(mappings) == sorted(config.SUBSECTIONS)
    assert all(f.metadata["key"] == config.EACH_KEY for f in mappings.values())
    assert len(declared) == 94  # the schema's keys today: a new key is declared with knob()


def test_the_key_the_rules_and_the_help_are_derived_from_the_declarations():
    from onegpu.equivalence import NOT_IN_EQUIVALENCE_KEY
    assert NOT_IN_EQUIVALENCE_KEY == config.out_of_key()
    assert NOT_IN_EQUIVALENCE_KEY["train.gradient_accumulation_steps"].startswith("how the effective batch is split")
    assert "train.learning_rate" not in NOT_IN_EQUIVALENCE_KEY and "data.packing" not in NOT_IN_EQUIVALENCE_KEY
    assert config.RULES["train.optim"][0]("adamw_torch_4bit") and not config.RULES["train.optim"][0]("adam")
    assert config.help_text("train.gradient_accumulation_steps") == "micro-batches per optimizer step"


def _params_yaml_lines() -> list[tuple[str, str]]:
    """(dotted key, its comment) of each key line of the committed params.yaml, in file order."""
    out, stack = [], []
    for line in defaults.params_text().splitlines():
        m = re.match(r"^( *)([A-Za-z_]\w*):[^#]*?(?:#\s?(.*))?$", line)
        if m:
            stack = stack[:len(m.group(1)) // 2] + [m.group(2)]
            out.append((".".join(stack), (m.group(3) or "").strip()))
    return out


def test_params_yaml_holds_every_key_in_schema_order_with_its_declared_help():
    """params.yaml's comment on each key's line is the key's declared help (config.knob), word for word."""
    lines = [(k, c) for k, c in _params_yaml_lines() if k not in config.SECTIONS]
    assert [k for k, _ in lines] == list(config.declarations(leaves=False))
    for key, comment in lines:
        assert comment == config.help_text(key), key


def test_every_key_of_the_schema_is_in_params_yaml():
    """`dvc exp run -S section.key=value` sets only keys params.yaml has (a missing one, or one under a
    null, fails in DVC: "Key ... is not in struct"): every documented knob is there, nested ones too."""
    have = config.flatten(defaults.params())
    assert sorted(set(config.flatten(config.Config().to_dict())) - set(have) - {"model.lora"}) == []
    assert {k for k in have if k.startswith("model.lora.")} == {f"model.lora.{f}" for f in
                                                                ("r", "alpha", "dropout", "target_modules")}
