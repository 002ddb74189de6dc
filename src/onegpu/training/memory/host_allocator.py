"""Where a CPU training takes its tensor memory from: ``train.cpu_allocator``.

On a CPU, PyTorch takes tensor memory from the C library's ``malloc``. glibc's defaults suit programs
that allocate little: a block above the mmap threshold (dynamic, at most 32 MiB) is its own ``mmap``,
returned with ``munmap`` when the tensor is freed, and free memory at the top of the heap above the trim
threshold goes back to the kernel. A training step frees and allocates the same activations and
gradients every step, so the kernel maps and zero-fills the same pages again and again (minor page faults
and system CPU time on the default job: ``bench/cpu_allocator.py``, ``bench/results/cpu_allocator.md``).

``caching`` (the default) keeps freed memory in the process for the next step, as PyTorch's CUDA
caching allocator keeps device memory on a GPU: ``mallopt(M_MMAP_THRESHOLD, 1 GiB)`` (blocks below
1 GiB come from the heap and are reused) and ``mallopt(M_TRIM_THRESHOLD, 2 GiB - 1)`` (free heap stays
mapped): fewer page faults and more peak RSS (freed memory stays in the process), its speed against
``system`` measured in ``bench/results/cpu_allocator.md``. ``system`` leaves glibc's defaults. Neither
changes a computed value, only where its memory comes from, so the knob is outside the equivalence key.

Sources: glibc mallopt(3) (``M_MMAP_THRESHOLD``, ``M_TRIM_THRESHOLD``, and that setting either turns
off the dynamic threshold); PyTorch's Performance Tuning Guide, "Switch Memory allocator" (for CPU
training it advises jemalloc or TCMalloc, which reuse memory; this does the same with the allocator
already loaded, no extra library or ``LD_PRELOAD``).

The settings are process-wide and cannot be undone: glibc has no call that brings back its dynamic
defaults. One training per process (the train stage, each torchrun process) applies them once.
"""
from __future__ import annotations

import ctypes
import ctypes.util

from onegpu.config import CPU_ALLOCATORS as CHOICES

# mallopt(3) parameter numbers (glibc malloc.h) and the values ``caching`` sets.
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 1 << 30           # bytes: blocks below 1 GiB come from the heap
TRIM_THRESHOLD = 2**31 - 1         # bytes: mallopt takes an int; free heap below 2 GiB stays mapped

_state = {"applied": None}  # the description once ``caching`` was set in this process


def _mallopt():
    """glibc's ``mallopt``, or None where the C library is not glibc (macOS, musl)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.mallopt
        _ = libc.gnu_get_libc_version  # glibc only: musl has no mallopt parameters of these numbers
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return fn


def apply(setting: str, device: str) -> str:
    """Apply ``train.cpu_allocator`` for a training on ``device``; returns what holds, in words (the
    run's ``cpu_allocator`` tag).

    Args:
        setting: ``"caching"`` or ``"system"`` (:data:`CHOICES`).
        device: the training device, ``"cpu"`` or ``"cuda:N"``: only a CPU training changes anything
            (on a GPU the tensors live in the CUDA caching allocator's device memory already, and a
            large host heap kept after the model moved to the GPU would only hold RAM).
    Raises:
        ValueError: ``setting`` is not one of :data:`CHOICES` (config validation names it first).
    """
    if setting not in CHOICES:
        raise ValueError(f"train.cpu_allocator must be one of {', '.join(CHOICES)}, got {setting!r}")
    if _state["applied"]:
        if setting == "system":
            return f"{_state['applied']} (set earlier in this process; glibc cannot restore its defaults)"
        return _state["applied"]
    if setting == "system" or not device.startswith("cpu"):
        return "system" if setting == "system" else f"system (training on {device}: host memory is not the tensors')"
    mallopt = _mallopt()
    if mallopt is None:
        return "system (the C library is not glibc: no mallopt)"
    if not (mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        return "system (glibc refused the mallopt values)"
    _state["applied"] = (f"caching (glibc mallopt: M_MMAP_THRESHOLD {MMAP_THRESHOLD >> 20} MiB, "
                         f"M_TRIM_THRESHOLD {TRIM_THRESHOLD >> 20} MiB)")
    return _state["applied"]


def release() -> bool:
    """Give the free heap back to the kernel (glibc's ``malloc_trim(0)``), once, after work that is not
    the training's: a validation pass's blocks, kept by ``caching``, would otherwise stay in the process and
    count in the next steps' RSS peaks. Returns whether glibc released anything; False where the C
    library is not glibc (nothing to do)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return bool(trim(0))
