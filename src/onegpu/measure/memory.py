"""Memory and time measurement: the only module that reads ``torch.cuda`` memory statistics (the step
peaks, the ``auto`` finder's probe peak, free device memory) and the one place that asks whether CUDA is
available (:func:`cuda_available`).

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
    (Read here, not through psutil: its ``memory_info`` has the current RSS only, not this resettable peak.)
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


def cuda_available() -> bool:
    """Whether torch sees a CUDA GPU (``torch.cuda.is_available()``)."""
    import torch
    return torch.cuda.is_available()


def device_facts():
    """What this machine offers for the config's device checks (:class:`onegpu.config.DeviceFacts`):
    CUDA and its GPUs (count, first one's name, bf16 and TF32 support) and the optional packages of
    :data:`onegpu.config.OPTIONAL_PACKAGES` that are installed."""
    import importlib.util

    from onegpu.config import OPTIONAL_PACKAGES, DeviceFacts
    packages = frozenset(p for p in OPTIONAL_PACKAGES if importlib.util.find_spec(p) is not None)
    if not cuda_available():
        return DeviceFacts(packages=packages)
    import torch
    from transformers.utils import is_torch_tf32_available
    return DeviceFacts(cuda=True, gpus=torch.cuda.device_count(), name=torch.cuda.get_device_name(0),
                       bf16=torch.cuda.is_bf16_supported(), tf32=is_torch_tf32_available(), packages=packages)


def default_device() -> str:
    """``"cuda:0"`` when a CUDA GPU is visible, else ``"cpu"``: the device every stage runs on."""
    return "cuda:0" if cuda_available() else "cpu"


def is_cuda(device) -> bool:
    """Whether ``device`` (a ``torch.device`` or a string such as ``"cuda:0"``) is a CUDA device."""
    return str(device).startswith("cuda")


def empty_cache() -> None:
    """Return the CUDA allocator's cached free blocks to the device (no-op without CUDA)."""
    if cuda_available():
        import torch
        torch.cuda.empty_cache()


def free_bytes(device) -> int:
    """Free memory on CUDA ``device`` in bytes (``torch.cuda.mem_get_info``)."""
    import torch
    free, _total = torch.cuda.mem_get_info(device)
    return int(free)


def synchronize(device) -> None:
    """Wait for queued CUDA work on ``device`` (no-op on CPU), so wall times cover the work."""
    if is_cuda(device):
        import torch
        torch.cuda.synchronize(device)


def reset_peak(device) -> None:
    """Start a new peak-memory window on ``device`` (CUDA allocator peak, or process RSS peak)."""
    if is_cuda(device):
        import torch
        torch.cuda.reset_peak_memory_stats(device)
    else:
        reset_rss_peak()


def peak_bytes(device) -> int:
    """Peak memory in bytes since :func:`reset_peak`: CUDA ``max_memory_allocated``, else RSS peak."""
    if is_cuda(device):
        import torch
        return int(torch.cuda.max_memory_allocated(device))
    return rss_peak_bytes()


def device_name(device) -> str:
    """``'cpu'`` or the CUDA device's name, e.g. ``'NVIDIA H200'`` (the contract's ``device`` tag)."""
    if is_cuda(device):
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


# --- the memory breakdown ------------------------------------------------------------------------

def _storage_key(t) -> tuple:
    s = t.untyped_storage()
    return (s.device.type, s.device.index, s.data_ptr())


def _plain_tensors(t):
    """``t`` itself, or for a wrapper tensor subclass (torchao's ``OptimState8bit``/``OptimState4bit``,
    a ``DTensor``) the plain tensors that hold its data (8-bit: ``codes`` uint8 of the logical shape,
    ``scale`` fp32 per block, ``qmap`` fp32 lookup table), found through ``__tensor_flatten__``, nested
    subclasses unwrapped too. Such a wrapper has no storage of its own: its ``untyped_storage()`` is a
    placeholder of the logical shape's size (fp32 for a 4-bit state) with no data pointer."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass
    if not is_traceable_wrapper_subclass(t):
        yield t
        return
    names, _ = t.__tensor_flatten__()
    for name in names:
        yield from _plain_tensors(getattr(t, name))


def tensors_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a view or a shared tensor counts once; a wrapper
    tensor subclass by the storages of the plain tensors inside it: :func:`_plain_tensors`)."""
    seen: dict = {}
    for t in (p for x in tensors if x is not None for p in _plain_tensors(x)):
        if not hasattr(t, "untyped_storage"):
            continue
        k = _storage_key(t)
        seen[k] = max(seen.get(k, 0), t.untyped_storage().nbytes())
    return sum(seen.values())


def state_bytes(model, optimizer=None) -> dict[str, int]:
    """Exact bytes of parameters, gradients and optimizer states that exist now, all dtypes.

    Call after the first optimizer step (before ``zero_grad``) so that gradients and lazily created
    optimizer states (AdamW's ``exp_avg``/``exp_avg_sq``: 2 x the trainable parameters in fp32) exist.
    Optimizer bytes are read from the optimizer's real state, whatever its shape and dtype: Adafactor's
    factored row and column moments, bitsandbytes' uint8 states with their fp32 block maxima (a buffer
    shared between parameters, such as its quantization map, counts once), torchao's 8-bit and 4-bit
    states (``adamw_torch_8bit``/``4bit``) by the codes, block scales and quantization map inside them, not
    by their fp32 logical shape. Per-parameter state buffers only; 0-dim counters (AdamW's ``step``,
    Adafactor's ``RMS``) are left out.
    Returns:
        ``mem_params_bytes``, ``mem_grads_bytes``, ``mem_optimizer_bytes`` (int, bytes).
    """
    import torch
    params = list(model.parameters())
    out = {"mem_params_bytes": tensors_bytes(params),
           "mem_grads_bytes": tensors_bytes(p.grad for p in params if p.grad is not None)}
    opt_tensors = []
    if optimizer is not None:
        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer
        for state in inner.state.values():
            # Per-parameter buffers only: 0-dim bookkeeping such as AdamW's ``step`` (4 bytes per
            # parameter tensor) is left out, so AdamW reads exactly 2 x the trainable parameters.
            opt_tensors.extend(v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    out["mem_optimizer_bytes"] = tensors_bytes(opt_tensors)
    return out


# The breakdown's line for the bf16/fp16 weight copies autocast makes (see :func:`saved_bytes`).
AUTOCAST_WEIGHTS = "mem_autocast_weights_bytes"


def activation_bytes(model, batch: dict, loss_fn) -> int:
    """Bytes that autograd saves for backward in one forward pass of ``batch`` (one micro-batch), the
    autocast weight copies left out: ``saved_bytes(...)["activations"]`` (see :func:`saved_bytes`)."""
    return saved_bytes(model, batch, loss_fn)["activations"]


def _param_copy(t, params_by_numel: dict) -> bool:
    """Whether saved tensor ``t`` is a lower-precision copy of a parameter (or its transpose), as
    autocast makes one for each matmul's weight: a parameter of the same element count and shape (or
    reversed shape, for ``weight.t()``) in another dtype, equal to it once rounded to ``t``'s dtype.
    One parameter is cast at a time (no copy of the whole model is held)."""
    import torch
    for p in params_by_numel.get(t.numel(), ()):
        if p.dtype == t.dtype or not (t.is_floating_point() and p.is_floating_point()):
            continue
        views = ([t] if t.shape == p.shape else []) + ([t.t()] if t.dim() == 2 and t.shape == p.shape[::-1] else [])
        if views:
            with torch.no_grad():
                cast = p.to(t.dtype)
                if any(torch.equal(v, cast) for v in views):
                    return True
    return False


def saved_bytes(model, batch: dict, loss_fn) -> dict[str, int]:
    """What autograd saves for backward in one forward pass of ``batch`` (one micro-batch), in bytes:
    ``{"activations": ..., "autocast_weights": ...}``.

    Counted with ``torch.autograd.graph.saved_tensors_hooks``: every tensor packed for backward, each
    storage once, parameter storages left out (they exist anyway). ``activations`` grow with the rows of
    the micro-batch; that is what activation checkpointing and a smaller micro-batch reduce (the same on
    CPU and GPU). ``autocast_weights``: under bf16/fp16 autocast (when the caller runs this inside it, as
    training does), the 2-byte copy of each matmul's weight that autocast makes once per forward pass
    and the matmul's backward keeps (2 bytes per weight element, whatever the micro-batch); 0 in fp32.
    torch's autocast: ``aten/src/ATen/autocast_mode.cpp`` (``cached_cast``, cache cleared on exit).

    The pass runs in train mode under the model's current checkpointing setting, then the graph is
    dropped without a backward pass. RNG states are restored afterwards, so the probe changes nothing
    the real run sees.

    Args:
        batch: collated micro-batch (tensors on the model's device) including ``labels``.
        loss_fn: ``(outputs, labels) -> loss``.
    """
    import torch
    param_keys = {_storage_key(t) for p in model.parameters() for t in _plain_tensors(p)  # a DTensor: its shard
                  if hasattr(t, "untyped_storage")}
    by_numel: dict = {}
    for q in model.parameters():
        by_numel.setdefault(q.numel(), []).append(q)
    saved: dict = {}
    copies: set = set()

    def pack(t):
        try:
            k = _storage_key(t)
            if k not in param_keys:
                saved[k] = max(saved.get(k, 0), t.untyped_storage().nbytes())
                if k not in copies and _param_copy(t, by_numel):
                    copies.add(k)
        except (RuntimeError, NotImplementedError):  # tensors without storage (e.g. some subclasses)
            pass
        # Detached: a saved output packed as itself would hold its own grad_fn, a reference cycle that
        # keeps the probe's activations and graph alive until the garbage collector runs.
        return t.detach()

    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    was_training = model.training
    model.train()
    try:
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(**inputs)
            loss = loss_fn(out, batch["labels"])
        del out, loss
    finally:
        model.train(was_training)
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
    weights = sum(saved[k] for k in copies)
    return {"activations": sum(saved.values()) - weights, "autocast_weights": weights}


def cuda_peaks(device) -> dict[str, int]:
    """``mem_allocated_peak_bytes`` and ``mem_reserved_peak_bytes`` since the last reset (CUDA only)."""
    if not is_cuda(device):
        return {}
    import torch
    return {"mem_allocated_peak_bytes": int(torch.cuda.max_memory_allocated(device)),
            "mem_reserved_peak_bytes": int(torch.cuda.max_memory_reserved(device))}


def cuda_step_peak(model, batch: dict, loss_fn, device, forward_context=None) -> int:
    """Allocator peak (bytes, ``torch.cuda.max_memory_allocated``) of one forward + backward of ``batch``
    on CUDA ``device``; gradients are dropped and the RNG states restored afterwards.
    ``forward_context``: a context manager the forward pass and loss run in (the training's autocast);
    the backward pass runs outside it, as torch's autocast recipe asks.

    Raises:
        torch.OutOfMemoryError: the step does not fit.
    """
    import torch
    cpu_rng, cuda_rng = torch.get_rng_state(), torch.cuda.get_rng_state_all()
    model.train()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    try:
        import contextlib
        with forward_context or contextlib.nullcontext():
            out = model(**{k: v for k, v in batch.items() if k != "labels"})
            loss = loss_fn(out, batch["labels"])
        loss.backward()
        del out, loss
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device))
    finally:
        model.zero_grad(set_to_none=True)
        torch.set_rng_state(cpu_rng)
        torch.cuda.set_rng_state_all(cuda_rng)
        torch.cuda.empty_cache()
