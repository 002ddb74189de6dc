"""The seconds a process has spent compiling (``torch.compile``: TorchDynamo and its backend, inductor by
default; torchao's low-bit optimizers compile their step the same way), so that a step which compiled can
be told from a steady one.

TorchDynamo times each compilation into ``torch._dynamo.utils.compilation_time_metrics`` (event name ->
the seconds of each event). Two names are top-level, every other is nested in one of them:
``_compile.compile_inner`` (a Python frame traced and compiled, its forward graph included) and
``backward._backward_impl`` (a backward graph, compiled on its first call). A torch that renames them still
counts as compiling (:class:`Compilations` sees new events of any name), only the seconds then read 0.
Reading costs a dict walk, no sync and no import: a process that never imported TorchDynamo compiled
nothing.
"""
from __future__ import annotations

import sys

TOP_LEVEL = ("_compile.compile_inner", "backward._backward_impl")


def _metrics() -> dict[str, list[float]]:
    utils = sys.modules.get("torch._dynamo.utils")
    return getattr(utils, "compilation_time_metrics", None) or {}


class Compilations:
    """The compile time between two reads: ``lap()`` returns the seconds compiled since the previous
    ``lap()`` (or since it was made), a positive figure whenever anything compiled meanwhile (at least
    :data:`ANY` when only events outside :data:`TOP_LEVEL` appeared). ``torch._dynamo.reset()`` clears
    TorchDynamo's figures (a new list per name afterwards): a lap across it counts the new lists whole.
    The lists seen last are held, so a new one can never take an old one's identity."""

    ANY = 1e-6  # seconds: a lap in which something compiled that the top-level figures missed

    def __init__(self) -> None:
        self._seen = self._snapshot()

    @staticmethod
    def _snapshot() -> dict[str, tuple[list[float], int]]:
        return {k: (v, len(v)) for k, v in _metrics().items()}

    def lap(self) -> float:
        now, seconds, events = self._snapshot(), 0.0, 0
        for k, (values, _) in now.items():
            old, old_n = self._seen.get(k, (None, 0))
            fresh = values[old_n:] if old is values else values
            events += len(fresh)
            seconds += sum(fresh) if k in TOP_LEVEL else 0.0
        self._seen = now
        return max(seconds, self.ANY) if events else 0.0
