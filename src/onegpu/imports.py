"""What an ``onegpu`` command process imports: transformers' optional packages that no onegpu work uses are
left unimported (:func:`skip_unused_optionals`, from :func:`onegpu.interpreter.start`).

transformers decides at import time whether an optional package is installed, and a module whose code may use
it imports it then, used or not. Two of these cost a stage process most of its start (docs/details.md, "A stage
process's start"): ``transformers.quantizers`` imports torchao (a second of CPU with its ``torch._dynamo``
registrations) for loading torchao-quantized checkpoints, and the detection losses of
``transformers.loss.loss_utils`` import ``scipy.optimize`` (the Hungarian matcher of DETR-like models). onegpu
loads no quantized checkpoint and trains no detection model; torchao's low-bit AdamW (``train.optim:
adamw_torch_8bit`` / ``adamw_torch_4bit``) asks for torchao when its optimizer is built, and then gets it
(:func:`allow`).

How: an import hook (:class:`_Patch`) wraps ``transformers.utils.import_utils``' availability checks of
:data:`SKIPPED` as soon as that module is imported, and before any module binds them, so that they answer
False until :func:`allow` names the package. Nothing changes in a process that imports onegpu as a library
(a notebook, bench/, the tests) unless it calls :func:`skip_unused_optionals` itself.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

# transformers.utils.import_utils' check -> the package it checks.
SKIPPED = {"is_torchao_available": "torchao", "is_scipy_available": "scipy"}
TARGET = "transformers.utils.import_utils"
_allowed: set[str] = set()


def allow(package: str) -> None:
    """From now on this process's transformers sees ``package`` (a value of :data:`SKIPPED`) as installed
    if it is: call before the code that needs it (torchao's optimizer, say) runs."""
    _allowed.add(package)


def _gated(check, package: str):
    def gated(*args, **kwargs):
        return package in _allowed and check(*args, **kwargs)
    gated.__name__ = gated.__qualname__ = check.__name__
    gated.__doc__ = (check.__doc__ or "") + f"\n\n(onegpu: False unless onegpu.imports.allow({package!r}).)"
    return gated


def _patch(module) -> None:
    for name, package in SKIPPED.items():
        check = getattr(module, name, None)
        if check is not None and not getattr(check, "_onegpu_gated", False):
            gated = _gated(check, package)
            gated._onegpu_gated = True
            setattr(module, name, gated)


class _Patch(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """A finder for :data:`TARGET` alone: the module is found and executed by the regular machinery, then
    :func:`_patch` runs on it before the importer (``transformers.utils``) binds its names."""

    def find_spec(self, fullname, path, target=None):
        if fullname != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        self._loader = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        _patch(module)


def skip_unused_optionals() -> None:
    """Install the hook (once; where transformers is already imported, patch its checks in place: modules
    that bound them already keep the originals)."""
    if TARGET in sys.modules:
        _patch(sys.modules[TARGET])
    elif not any(isinstance(f, _Patch) for f in sys.meta_path):
        sys.meta_path.insert(0, _Patch())
