"""The compile seconds between two reads (onegpu.measure.compilation), from TorchDynamo's own timings."""
from __future__ import annotations

import torch

from onegpu.measure import compilation


def test_a_lap_counts_what_compiled_since_the_last_and_nothing_when_nothing_did():
    laps = compilation.Compilations()
    fn = torch.compile(lambda x: torch.tanh(x) + 3, backend="eager")
    assert laps.lap() == 0.0  # torch.compile itself compiles nothing until the first call
    fn(torch.ones(4))
    first = laps.lap()
    inner = torch._dynamo.utils.compilation_time_metrics["_compile.compile_inner"]
    assert first > 0.0 and first == sum(inner[-1:])  # the one frame compiled, as TorchDynamo timed it
    fn(torch.ones(4))  # the same shapes: the compiled code runs
    assert laps.lap() == 0.0
    fn(torch.ones(4, 2))  # another rank of input: a recompilation
    assert laps.lap() > 0.0


def test_a_reset_of_torchdynamo_between_laps_counts_what_compiled_after_it():
    """A reset clears TorchDynamo's timings; the same compilation again after it (as many events as before
    the reset) is still counted."""
    laps = compilation.Compilations()
    fn = lambda x: x * 5 - 1  # noqa: E731
    torch.compile(fn, backend="eager")(torch.ones(2))
    assert laps.lap() > 0.0
    torch._dynamo.reset()
    assert torch._dynamo.utils.compilation_time_metrics == {}
    assert laps.lap() == 0.0  # nothing compiled since the reset
    torch.compile(fn, backend="eager")(torch.ones(2))
    assert laps.lap() > 0.0
