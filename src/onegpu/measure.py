"""Memory and time measurement: the only module that reads ``torch.cuda`` memory statistics.

Memory figures are bytes. On CUDA the step peak is the caching allocator's peak of allocated bytes
(``torch.cuda.max_memory_allocated``), reset at the start of each step and each stage; it leaves out
the CUDA context and the allocator's reserved-but-free blocks. On CPU it is the process's peak resident
set size (Linux ``VmHWM``), which :func:`reset_rss_peak` resets through ``/proc/self/clear_refs``
(``echo 5``, Linux >= 4.0, see proc(5)).
"""
from __future__ import annotations

import os
import resource
import time


def rss_peak_bytes() -> int:
    """Peak resident set size of this process since the last reset, in bytes (``VmHWM``).

    Falls back to ``getrusage(RUSAGE_SELF).ru_maxrss`` (KiB on Linux, never reset) where /proc is absent.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_rss_peak() -> bool:
    """Reset ``VmHWM`` to the current RSS. Returns False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _cuda(device) -> bool:
    return str(device).startswith("cuda")


def synchronize(device) -> None:
    """Wait for queued CUDA work on ``device`` (no-op on CPU), so wall times cover the work."""
    if _cuda(device):
        import torch
        torch.cuda.synchronize(device)


def reset_peak(device) -> None:
    """Start a new peak-memory window on ``device`` (CUDA allocator peak, or process RSS peak)."""
    if _cuda(device):
        import torch
        torch.cuda.reset_peak_memory_stats(device)
    else:
        reset_rss_peak()


def peak_bytes(device) -> int:
    """Peak memory in bytes since :func:`reset_peak`: CUDA ``max_memory_allocated``, else RSS peak."""
    if _cuda(device):
        import torch
        return int(torch.cuda.max_memory_allocated(device))
    return rss_peak_bytes()


def device_name(device) -> str:
    """``'cpu'`` or the CUDA device's name, e.g. ``'NVIDIA H200'`` (the contract's ``device`` tag)."""
    if _cuda(device):
        import torch
        return torch.cuda.get_device_name(device)
    return str(device).split(":")[0]


class Stopwatch:
    """Wall time in seconds with ``time.perf_counter``; ``lap()`` returns seconds since the last lap."""

    def __init__(self) -> None:
        self.start = self.last = time.perf_counter()

    def lap(self) -> float:
        now = time.perf_counter()
        dt, self.last = now - self.last, now
        return dt

    def total(self) -> float:
        return time.perf_counter() - self.start


def cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
