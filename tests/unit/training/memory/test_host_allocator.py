"""train.cpu_allocator: the caching setting stops the kernel from mapping and zero-filling the same
memory again for every tensor a training step frees and allocates (counted as minor page faults)."""
from __future__ import annotations

import json
import statistics
import subprocess
import sys

import pytest

from onegpu.training.memory import host_allocator

# One "step" frees and allocates a 64 MiB tensor, as a step does with the embedding gradient; the
# minor page faults of each step are counted.
_STEPS = """
import json, resource, sys, torch
from onegpu.training.memory import host_allocator
said = host_allocator.apply(sys.argv[1], "cpu")
torch.empty(1 << 24).fill_(1.0)  # a first allocation, outside the count
faults = []
for _ in range(20):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t = torch.empty(1 << 24)  # 64 MiB of float32
    t.fill_(1.0)
    del t
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"said": said, "faults": faults}))
"""

PAGES_PER_STEP = (64 << 20) // 4096  # 16,384 pages of 4 KiB in a 64 MiB tensor


def _faults(setting: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _STEPS, setting], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(host_allocator._mallopt() is None, reason="needs glibc (mallopt)")
def test_caching_reuses_freed_memory_where_glibc_maps_it_afresh_every_step():
    system, caching = _faults("system"), _faults("caching")
    assert system["said"] == "system"
    assert caching["said"].startswith("caching (glibc mallopt: M_MMAP_THRESHOLD 1024 MiB")
    # glibc's defaults: every 64 MiB tensor is a new mmap, all of its pages faulted in again.
    assert statistics.median(system["faults"]) >= PAGES_PER_STEP * 0.9, system["faults"]
    # caching: the freed block is reused, a typical step faults in (almost) nothing. The median, since
    # the kernel may reclaim idle free pages now and then (seen under load: a few steps refault).
    assert statistics.median(caching["faults"]) <= PAGES_PER_STEP * 0.1, caching["faults"]


def test_nothing_changes_for_a_gpu_training_or_when_system_is_asked(monkeypatch):
    calls = []
    monkeypatch.setattr(host_allocator, "_mallopt", lambda: lambda *a: calls.append(a) or 1)
    monkeypatch.setattr(host_allocator, "_state", {"applied": None})
    assert host_allocator.apply("caching", "cuda:0").startswith("system (training on cuda:0")
    assert host_allocator.apply("system", "cpu") == "system"
    assert calls == []
    said = host_allocator.apply("caching", "cpu")
    assert calls == [(host_allocator.M_MMAP_THRESHOLD, 1 << 30), (host_allocator.M_TRIM_THRESHOLD, 2**31 - 1)]
    # Once set, a process cannot go back to glibc's dynamic defaults: a later run is told so.
    assert host_allocator.apply("caching", "cpu") == said and len(calls) == 2
    assert host_allocator.apply("system", "cpu") == said + " (set earlier in this process; glibc cannot restore " \
                                                           "its defaults)"


def test_without_glibc_it_says_so(monkeypatch):
    monkeypatch.setattr(host_allocator, "_mallopt", lambda: None)
    monkeypatch.setattr(host_allocator, "_state", {"applied": None})
    assert host_allocator.apply("caching", "cpu") == "system (the C library is not glibc: no mallopt)"
    with pytest.raises(ValueError, match="train.cpu_allocator must be one of caching, system, got 'jemalloc'"):
        host_allocator.apply("jemalloc", "cpu")


def test_release_gives_the_free_heap_back_to_the_kernel():
    """After a validation pass on a CPU (training.record.recorder): 200 MiB freed under the caching settings stay
    in the process until release() trims them."""
    import ctypes

    import psutil
    host_allocator.apply("caching", "cpu")
    blocks = [ctypes.create_string_buffer(1 << 20) for _ in range(200)]  # heap blocks (below the mmap threshold)
    del blocks
    held = psutil.Process().memory_info().rss
    assert host_allocator.release() is True
    assert psutil.Process().memory_info().rss < held - (100 << 20)
