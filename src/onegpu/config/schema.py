"""The whole params.yaml schema: :class:`Config` (one dataclass per section), its sections and mappings,
and what is derived from the declarations (:func:`declarations`, :func:`help_text`, :func:`out_of_key`,
:data:`RULES`)."""
from __future__ import annotations

from dataclasses import Field, asdict, dataclass, field, fields

from onegpu.config.data import DataConfig
from onegpu.config.evaluate import EvaluateConfig
from onegpu.config.grpo import GRPOConfig
from onegpu.config.knobs import OutOfKey, Rule
from onegpu.config.model import LoraConfig, ModelConfig
from onegpu.config.tracking import TrackingConfig
from onegpu.config.train import CheckpointingKwargs, DPOConfig, FSDPConfig, TrainConfig


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def to_dict(self) -> dict:
        return asdict(self)


# params.yaml's sections, in schema order, and the dataclass of each.
SECTIONS: dict[str, type] = {"data": DataConfig, "model": ModelConfig, "train": TrainConfig,
                             "evaluate": EvaluateConfig, "tracking": TrackingConfig}


# Mappings inside a section, by dotted name, and the dataclass of each.
SUBSECTIONS: dict[str, type] = {"model.lora": LoraConfig, "train.gradient_checkpointing_kwargs": CheckpointingKwargs,
                                "train.dpo": DPOConfig, "train.grpo": GRPOConfig, "train.fsdp": FSDPConfig}


def declarations(leaves: bool = True) -> dict[str, Field]:
    """Every declared params.yaml key by dotted name (``train.seed``), in schema order: the keys of the
    mappings (``model.lora.r``) in place of the mapping, or also the mapping itself (``leaves=False``)."""
    out: dict[str, Field] = {}

    def walk(cls: type, prefix: str) -> None:
        for f in fields(cls):
            name = f"{prefix}{f.name}"
            if name in SUBSECTIONS:
                if not leaves:
                    out[name] = f
                walk(SUBSECTIONS[name], name + ".")
            else:
                out[name] = f
    for section, cls in SECTIONS.items():
        walk(cls, section + ".")
    return out


def help_text(key: str) -> str:
    """The declared help of a dotted key (params.yaml's comment on its line).

    Raises:
        KeyError: no such key.
    """
    return declarations(leaves=False)[key].metadata["help"]


def out_of_key() -> dict[str, str]:
    """Every key declared out of the equivalence key, and why (``onegpu.equivalence.NOT_IN_EQUIVALENCE_KEY``)."""
    return {k: f.metadata["key"].why for k, f in declarations().items() if isinstance(f.metadata["key"], OutOfKey)}


# key -> (the value is allowed, the problem otherwise: ``{v}`` is the value), from the declarations; checked
# in schema order by :func:`validate` (the mappings' keys by their section's combination check).
RULES: dict[str, Rule] = {k: f.metadata["rule"] for k, f in declarations().items() if f.metadata["rule"]}
