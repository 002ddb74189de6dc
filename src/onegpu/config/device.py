"""The combinations this machine cannot run (:func:`check_device`), from the :class:`DeviceFacts` the
caller probes, so this package imports no torch."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from onegpu.config.knobs import fail
from onegpu.config.schema import Config
from onegpu.config.train import TORCHAO_OPTIMIZERS

# -- the machine: combinations this device cannot run ------------------------------------------------

# Optional packages that a params value needs (DeviceFacts.packages says which are installed).
OPTIONAL_PACKAGES = ("bitsandbytes", "flash_attn", "torchao")


@dataclass(frozen=True)
class DeviceFacts:
    """What the machine offers, as :func:`check_device` needs it; probed by the caller
    (:func:`onegpu.measure.memory.device_facts`), so this module imports no torch.

    ``cuda``: a CUDA GPU is visible; ``gpus``: how many; ``name``: the first GPU's name ("" without one);
    ``bf16`` / ``tf32``: that GPU runs bf16 / TF32 matmuls; ``packages``: the installed packages of
    :data:`OPTIONAL_PACKAGES`.
    """
    cuda: bool = False
    gpus: int = 0
    name: str = ""
    bf16: bool = False
    tf32: bool = False
    packages: frozenset = frozenset()


_NO_GPU = "needs a CUDA GPU and none is visible"
_OTHER_OPTIMIZERS = "use adamw_torch, adamw_torch_fused or adafactor"

# (key, the combination is bad on this machine, the problem): one line each, checked in this order.
# The problem is formatted with t = cfg.train, m = cfg.model, f = the DeviceFacts.
DEVICE_CHECKS: tuple[tuple[str, Callable[[Config, DeviceFacts], bool], str], ...] = (
    ("train.num_processes", lambda c, f: f.cuda and c.train.num_processes > f.gpus,
     "{t.num_processes} processes need {t.num_processes} GPUs (one each) and {f.gpus} is/are visible; set "
     "train.num_processes to at most {f.gpus}"),
    ("train.fp16", lambda c, f: c.train.fp16 and not f.cuda,
     f"fp16 mixed precision {_NO_GPU}; use bf16 (CPU autocast) or neither"),
    ("train.bf16", lambda c, f: c.train.bf16 and f.cuda and not f.bf16,
     "{f.name} has no bf16 support; use fp16 or neither"),
    ("train.optim", lambda c, f: c.train.optim == "adamw_bnb_8bit" and "bitsandbytes" not in f.packages,
     "adamw_bnb_8bit needs the bitsandbytes package, which is not installed (pip install bitsandbytes); or "
     + _OTHER_OPTIMIZERS),
    ("train.optim", lambda c, f: c.train.optim == "adamw_bnb_8bit" and not f.cuda,
     f"adamw_bnb_8bit (bitsandbytes) {_NO_GPU}; {_OTHER_OPTIMIZERS}"),
    ("train.optim", lambda c, f: c.train.optim in TORCHAO_OPTIMIZERS and "torchao" not in f.packages,
     "{t.optim} needs the torchao package, which is not installed (pip install torchao); or " + _OTHER_OPTIMIZERS),
    ("model.attn_implementation",
     lambda c, f: c.model.attn_implementation == "flash_attention_2" and "flash_attn" not in f.packages,
     "flash_attention_2 needs the flash_attn package, which is not installed; use sdpa, eager or null"),
    ("model.attn_implementation", lambda c, f: c.model.attn_implementation == "flash_attention_2" and not f.cuda,
     f"flash_attention_2 {_NO_GPU}; use sdpa, eager or null"),
    ("train.activation_offloading", lambda c, f: c.train.activation_offloading and not f.cuda,
     f"activation offloading moves saved activations from the GPU to host memory and {_NO_GPU} (on a CPU they "
     "are in host memory already); set train.activation_offloading: false"),
    # TF32 is a CUDA matmul mode: a no-op on a CPU (fp32 there), so it passes without CUDA.
    ("train.tf32", lambda c, f: c.train.tf32 and f.cuda and not f.tf32,
     "{f.name} has no TF32 (needs an Ampere or newer GPU); set train.tf32: false"),
)


def check_device(cfg: Config, facts: DeviceFacts, source: str = "params.yaml") -> None:
    """The combinations of ``cfg`` that this machine (``facts``) cannot run: each entry of
    :data:`DEVICE_CHECKS`, in order, before any work.

    Raises:
        ConfigError: the first bad combination, in one line naming the key and what to do instead.
    """
    for key, bad, problem in DEVICE_CHECKS:
        if bad(cfg, facts):
            fail(source, key, problem.format(t=cfg.train, m=cfg.model, f=facts))
