"""Outside load: how much of the machine other processes took while a run trained.

A run's speed is the cost of its settings only when the run had the machine to itself. :class:`Watch`
samples, at the start and the end of the training window, the machine's busy CPU time (psutil's
system-wide ``cpu_times``: user + nice + system + irq + softirq + steal; steal is CPU a hypervisor gave
to another guest), this process tree's own CPU time (the training process and its children; under a
multi-process launch the launcher's tree, so the other ranks are "own") and the load average; on CUDA
also the other processes on the device (NVML through ``pynvml``, where installed). The result:

- ``cpu_busy``: the CPUs' worth other processes kept busy over the window, ``(machine busy - own) / wall``
  seconds (e.g. 1.42 = one core and a half);
- ``cpus``: logical CPUs (``os.cpu_count()``); ``share``: ``cpu_busy / cpus``;
- ``loadavg``: the 1-minute load average at the start and the end (it counts this run too);
- ``gpu_processes``: other processes on the run's GPU (None: not known, e.g. no ``pynvml``).

A run is **under outside load** (:func:`under_load`) when other processes took at least
:data:`UNDER_LOAD_SHARE` of the CPUs or any other process used its GPU. The train stage logs the
figures as the tag :data:`TAG` (JSON) and the metric :data:`METRIC` (``cpu_busy``); ``onegpu compare``,
``onegpu tradeoffs`` and ``onegpu summary`` mark the costs of such runs with :func:`describe`.
Imports only the standard library at module level (compare and summary read it without psutil).
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

TAG = "onegpu.outside_load"
METRIC = "train_outside_cpu_load"
# Other processes' share of the CPUs from which a run counts as measured under load: well above what a
# quiet machine's daemons take (bench/results/measured_notes.md); at 10% a training that uses every core
# loses about that much of its speed.
UNDER_LOAD_SHARE = 0.10


@dataclass(frozen=True)
class Sample:
    """One reading: ``wall`` (``time.monotonic()`` s), ``busy_s`` (machine-wide busy CPU seconds since
    boot), ``own_s`` (CPU seconds per pid of this process tree, its reaped children included) and
    ``loadavg`` (1-minute load average, None where the OS has none)."""
    wall: float
    busy_s: float
    own_s: dict
    loadavg: float | None


def _busy(times) -> float:
    """Busy seconds of psutil's ``cpu_times()`` (guest time is already inside ``user`` on Linux)."""
    return sum(getattr(times, f, 0.0) for f in ("user", "nice", "system", "irq", "softirq", "steal"))


def _tree(root: int) -> list:
    import psutil
    proc = psutil.Process(root)
    try:
        return [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return [proc]


def sample(root: int) -> Sample:
    """A :class:`Sample` of the machine and of the process tree rooted at pid ``root``."""
    import psutil
    own = {}
    for p in _tree(root):
        try:
            t = p.cpu_times()
        except psutil.Error:
            continue
        own[p.pid] = t.user + t.system + t.children_user + t.children_system
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = None
    return Sample(time.monotonic(), _busy(psutil.cpu_times()), own, load)


def figures(start: Sample, end: Sample, cpus: int, gpu_processes: int | None = None) -> dict:
    """The outside load between two samples (keys as in the module docstring, plus ``window_s``)."""
    wall = max(end.wall - start.wall, 1e-9)
    own = sum(max(v - start.own_s.get(pid, 0.0), 0.0) for pid, v in end.own_s.items())
    busy = max(end.busy_s - start.busy_s - own, 0.0) / wall
    return {"cpu_busy": round(busy, 3), "cpus": cpus, "share": round(busy / cpus, 3) if cpus else None,
            "loadavg": [start.loadavg, end.loadavg], "window_s": round(wall, 3), "gpu_processes": gpu_processes}


def other_gpu_processes(device: str, own_pids: set[int]) -> int | None:
    """Processes other than this tree's with a compute context on ``device`` (``cuda:N``), by NVML;
    None on CPU or without ``pynvml``. Where NVML's pids are of another pid namespace (a container) and
    none is ours, one of them is taken to be this process."""
    if not device.startswith("cuda"):
        return None
    try:
        import pynvml
        pynvml.nvmlInit()
        index = int(device.partition(":")[2] or 0)
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        pids = {p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)}
    except Exception:
        return None
    if pids & own_pids:
        return len(pids - own_pids)
    return max(len(pids) - 1, 0)


class Watch:
    """Measures the outside load over a window: ``start()``, then ``stop()`` (idempotent; returns the
    figures, or None when it never started or psutil failed). ``root``: the pid whose tree is "own"."""

    def __init__(self, device: str = "cpu", root: int | None = None) -> None:
        self.device, self.root = device, os.getpid() if root is None else root
        self._start: Sample | None = None
        self._gpu: int | None = None
        self.result: dict | None = None

    def start(self) -> None:
        try:
            self._start = sample(self.root)
            self._gpu = other_gpu_processes(self.device, set(self._start.own_s))
        except Exception:
            self._start = None

    def stop(self) -> dict | None:
        if self.result is None and self._start is not None:
            try:
                end = sample(self.root)
                gpu = other_gpu_processes(self.device, set(end.own_s))
                if self._gpu is not None or gpu is not None:
                    gpu = max(x for x in (self._gpu, gpu) if x is not None)
                self.result = figures(self._start, end, os.cpu_count() or 1, gpu)
            except Exception:
                self.result = None
        return self.result


def parse(tag: str | None) -> dict | None:
    """The figures from the :data:`TAG` tag's JSON; None when absent or unreadable."""
    if not tag:
        return None
    try:
        out = json.loads(tag)
    except ValueError:
        return None
    return out if isinstance(out, dict) else None


def under_load(info: dict | None) -> bool:
    """Whether other processes took at least :data:`UNDER_LOAD_SHARE` of the CPUs, or used the GPU."""
    if not info:
        return False
    share = info.get("share")
    return bool((share is not None and share >= UNDER_LOAD_SHARE) or info.get("gpu_processes"))


def describe(info: dict | None) -> str:
    """The load in words, e.g. ``other processes used 1.42 of 2 CPUs (71%), load average 3.1 -> 4.0``,
    plus ``; 1 other process on the GPU``; '' when ``info`` is None."""
    if not info:
        return ""
    parts = []
    if info.get("cpu_busy") is not None:
        text = f"other processes used {info['cpu_busy']:.2f} of {info.get('cpus', '?')} CPUs"
        if info.get("share") is not None:
            text += f" ({info['share']:.0%})"
        loads = [x for x in info.get("loadavg") or [] if x is not None]
        if len(loads) == 2:
            text += f", load average {loads[0]:.1f} -> {loads[1]:.1f}"
        parts.append(text)
    n = info.get("gpu_processes")
    if n:
        parts.append(f"{n} other process{'es' if n != 1 else ''} on the GPU")
    return "; ".join(parts)
