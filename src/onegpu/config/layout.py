"""The batch layout a run uses (:class:`Resolved`, :func:`resolve`, :func:`with_layout`) and
:func:`flatten`, the dotted names of a nested dict."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from onegpu.config.schema import Config
from onegpu.errors import ConfigError


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    """Flatten nested dicts with dots: ``{"train": {"seed": 1}}`` -> ``{"train.seed": 1}``."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


@dataclass(frozen=True)
class Resolved:
    """The batch layout actually used (logged as ``resolved.*``)."""
    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    world_size: int

    @property
    def effective_batch_size(self) -> int:
        """Examples per optimizer step: micro-batch x accumulation x processes."""
        return self.per_device_train_batch_size * self.gradient_accumulation_steps * self.world_size


def resolve(cfg: Config, world_size: int | None = None, micro_batch: int | None = None) -> Resolved:
    """The batch layout for ``cfg`` on ``world_size`` processes (None: ``train.num_processes``).

    With ``per_device_train_batch_size: auto`` the caller passes the finder's ``micro_batch``;
    accumulation is then ``effective_batch_size / (micro_batch x world_size)``.
    Raises:
        ConfigError: ``auto`` without ``micro_batch``, or a micro-batch that does not divide the effective batch.
    """
    t = cfg.train
    world_size = t.num_processes if world_size is None else world_size
    if t.per_device_train_batch_size != "auto":
        return Resolved(int(t.per_device_train_batch_size), t.gradient_accumulation_steps, world_size)
    if micro_batch is None:
        raise ConfigError("train.per_device_train_batch_size is 'auto': the micro-batch finder must run first")
    per_step = micro_batch * world_size
    if t.effective_batch_size % per_step:
        raise ConfigError(f"train.effective_batch_size={t.effective_batch_size} is not divisible by "
                          f"micro-batch {micro_batch} x {world_size} process(es)")
    return Resolved(micro_batch, t.effective_batch_size // per_step, world_size)



def with_layout(cfg: Config, layout: Resolved) -> Config:
    """``cfg`` with ``layout`` written into ``train`` (``per_device_train_batch_size``, an int, and
    ``gradient_accumulation_steps``): what a backend reads (an ``auto`` micro-batch replaced by the
    finder's). The params logged to MLflow stay ``cfg``'s.

    Raises:
        ValueError: ``layout`` is for another number of processes than ``train.num_processes``.
    """
    if layout.world_size != cfg.train.num_processes:
        raise ValueError(f"a layout for {layout.world_size} processes, "
                         f"train.num_processes is {cfg.train.num_processes}")
    return replace(cfg, train=replace(cfg.train, per_device_train_batch_size=layout.per_device_train_batch_size,
                                      gradient_accumulation_steps=layout.gradient_accumulation_steps))
