"""Test-only faults for the stage's processes, with this folder on ``PYTHONPATH`` (Python imports
``sitecustomize`` at start-up, the ``site`` module); every other process is left as it is:

- ``ONEGPU_TEST_FAULT=raise:<rank>:<step>``: the process of that rank raises right after optimizer step
  ``<step>`` (``StepRecorder.end_step``), as a rank whose own code fails would.
- ``ONEGPU_TEST_FAULT=raise_validating:<rank>:<step>``: the process of that rank raises in the validation
  pass after optimizer step ``<step>`` (``Validation.__call__``), while the others validate their shares.
- ``ONEGPU_TEST_FAULT=slow_validation:<rank>:<step>``: the validation pass after optimizer step ``<step>``
  prints ``test fault: validating after optimizer step <step>`` and takes 5 s more, before it validates
  (``Validation.__call__``), so that a signal sent on that line arrives during the pass.
- ``ONEGPU_TEST_DTYPE=float64``: torch's default dtype is float64 from start-up, so a model built from its config
  (``model.name_or_path: null``) and the loop's tensors are float64 (the per-step proofs' 1e-12).
"""
import os
import sys

if os.environ.get("ONEGPU_TEST_DTYPE") == "float64":
    import torch
    torch.set_default_dtype(torch.float64)

_SPEC = os.environ.get("ONEGPU_TEST_FAULT", "")
_KIND, _, _REST = _SPEC.partition(":")
_RANK, _, _STEP = _REST.partition(":")


def _failing_end_step(module) -> None:
    end_step = module.StepRecorder.end_step

    def failing_end_step(self, step, *a, **kw):
        out = end_step(self, step, *a, **kw)
        if step == int(_STEP):
            raise RuntimeError(f"injected failure on rank {_RANK} after optimizer step {step}")
        return out
    module.StepRecorder.end_step = failing_end_step


def _slow_validation(module) -> None:
    import time
    validate = module.Validation.__call__

    def slow(self, step, *a, **kw):
        if step == int(_STEP):
            print(f"test fault: validating after optimizer step {step}", flush=True)
            time.sleep(5)
        return validate(self, step, *a, **kw)
    module.Validation.__call__ = slow


def _failing_validation(module) -> None:
    validate = module.Validation.__call__

    def failing(self, step, *a, **kw):
        if step == int(_STEP):
            raise RuntimeError(f"injected failure on rank {_RANK} in the validation pass after optimizer step {step}")
        return validate(self, step, *a, **kw)
    module.Validation.__call__ = failing


_PATCHES = {"raise": ("onegpu.training.record.recorder", _failing_end_step),
            "raise_validating": ("onegpu.training.validation", _failing_validation),
            "slow_validation": ("onegpu.training.validation", _slow_validation)}

if _KIND in _PATCHES and os.environ.get("RANK", "0") == _RANK:
    import importlib.abc
    import importlib.machinery

    _MODULE, _PATCH = _PATCHES[_KIND]

    class _Hook(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != _MODULE:
                return None
            sys.meta_path.remove(self)
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            load = spec.loader.exec_module

            def exec_module(module):
                load(module)
                _PATCH(module)
            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _Hook())
