"""A test-only fault for the processes of a launch: with ``ONEGPU_TEST_FAULT=raise:<rank>:<step>`` in the
environment and this folder on ``PYTHONPATH``, the process of that rank raises right after optimizer step
``<step>`` (``StepRecorder.end_step``), as a rank whose own code fails would. Python imports
``sitecustomize`` at start-up (the ``site`` module); every other process is left as it is."""
import os
import sys

_SPEC = os.environ.get("ONEGPU_TEST_FAULT", "")
_KIND, _, _REST = _SPEC.partition(":")
_RANK, _, _STEP = _REST.partition(":")

if _KIND == "raise" and os.environ.get("RANK") == _RANK:
    import importlib.abc
    import importlib.machinery

    def _patch(module) -> None:
        end_step = module.StepRecorder.end_step

        def failing_end_step(self, step, *a, **kw):
            out = end_step(self, step, *a, **kw)
            if step == int(_STEP):
                raise RuntimeError(f"injected failure on rank {_RANK} after optimizer step {step}")
            return out
        module.StepRecorder.end_step = failing_end_step

    class _Hook(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != "onegpu.training.recorder":
                return None
            sys.meta_path.remove(self)
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            load = spec.loader.exec_module

            def exec_module(module):
                load(module)
                _patch(module)
            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _Hook())
