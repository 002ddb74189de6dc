"""Model FLOPs and MFU (model FLOPs utilisation).

Model FLOPs per trained token follow the standard estimate (Kaplan et al. 2020, "Scaling Laws for
Neural Language Models", sec. 2.1; PaLM, Chowdhery et al. 2022, appendix B):

    6 * N  +  12 * n_layer * d_model * T

with N the non-embedding parameters (forward 2N, backward 4N per token) and the second term the
attention scores and weighted sum at context T (here the mean padded length per micro-batch).
Checkpointing's recomputed forward is *not* counted: this is MFU, not HFU (hardware FLOPs utilisation).

Device peak: published dense peaks from the vendors' datasheets (table below), for the dtype the
matmuls run in; a device not in the table (a CPU, say) gets a short measured matmul peak in that
dtype, cached per machine under ``~/.cache/onegpu/peak_flops.json``.
"""
from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

# Dense (no sparsity) peak FLOP/s by device-name substring and dtype. Sources: NVIDIA datasheets --
# H100/H200 SXM ("NVIDIA H100 Tensor Core GPU" datasheet; "NVIDIA H200" product brief), A100 ("NVIDIA
# A100 Tensor Core GPU" datasheet, SXM), L4, A10, T4, V100 and GeForce RTX 3090/4090 (Ampere and Ada
# architecture whitepapers, FP16/BF16 tensor with FP32 accumulate). fp32 = plain FP32 (non-tensor);
# tf32 where PyTorch allows TF32 matmuls.
PEAKS: dict[str, dict[str, float]] = {
    "H200": {"bf16": 989e12, "fp16": 989e12, "tf32": 494e12, "fp32": 67e12},
    "H100": {"bf16": 989e12, "fp16": 989e12, "tf32": 494e12, "fp32": 67e12},
    "A100": {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12},
    "L4": {"bf16": 121e12, "fp16": 121e12, "tf32": 60e12, "fp32": 30.3e12},
    "A10": {"bf16": 125e12, "fp16": 125e12, "tf32": 62.5e12, "fp32": 31.2e12},
    "RTX 4090": {"bf16": 165e12, "fp16": 165e12, "tf32": 82.6e12, "fp32": 82.6e12},
    "RTX 3090": {"bf16": 71e12, "fp16": 71e12, "tf32": 35.6e12, "fp32": 35.6e12},
    "V100": {"fp16": 125e12, "fp32": 15.7e12},
    "T4": {"fp16": 65e12, "fp32": 8.1e12},
}

CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "onegpu" / "peak_flops.json"


def non_embedding_parameters(model) -> int:
    """Parameters outside embedding tables (``nn.Embedding`` weights), counted once."""
    import torch
    emb = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    seen, n = set(), 0
    for p in model.parameters():
        if id(p) not in seen and id(p) not in emb:
            seen.add(id(p))
            n += p.numel()
    return n


def flops_per_token(model, seq_len: float) -> float:
    """Model FLOPs to train on one token (forward + backward), see the module docstring."""
    cfg = model.config
    n_layer = getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layer", 0)
    d_model = getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd", 0)
    return 6.0 * non_embedding_parameters(model) + 12.0 * n_layer * d_model * seq_len


def matmul_dtype(bf16: bool, fp16: bool) -> str:
    if bf16:
        return "bf16"
    if fp16:
        return "fp16"
    return "fp32"


def device_peak(device_name: str, dtype: str, device: str = "cpu") -> tuple[float, str]:
    """Peak FLOP/s of ``device_name`` in ``dtype`` and where it came from ("datasheet" or "measured").

    On CUDA with fp32 and TF32 matmuls allowed, the tf32 peak is used.
    """
    for key, peaks in PEAKS.items():
        if key in device_name:
            d = dtype
            if d == "fp32" and device.startswith("cuda"):
                import torch
                if torch.backends.cuda.matmul.allow_tf32 and "tf32" in peaks:
                    d = "tf32"
            if d in peaks:
                return peaks[d], "datasheet"
    return measured_peak(device, dtype), "measured"


def measured_peak(device: str, dtype: str, size: int = 1024, seconds: float = 0.5) -> float:
    """Best FLOP/s of repeated ``size`` x ``size`` matmuls in ``dtype`` on ``device``, cached per machine.

    The cache key names the processor, the thread count and the dtype, so a different machine or
    thread setting measures again.
    """
    import torch
    key = f"{platform.processor() or platform.machine()}|{cpu_model()}|{device}|{torch.get_num_threads()}|{dtype}"
    try:
        cache = json.loads(CACHE.read_text())
    except (OSError, ValueError):
        cache = {}
    if key in cache:
        return float(cache[key])
    tdtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    # Constant inputs: matmul speed does not depend on the values, and the global RNG stays untouched.
    a = torch.full((size, size), 0.5, device=device, dtype=tdtype)
    b = torch.full((size, size), 0.25, device=device, dtype=tdtype)
    a @ b  # warm-up
    best, end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        for _ in range(4):
            a @ b
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        best = max(best, 4 * 2 * size**3 / (time.perf_counter() - t0))
    cache[key] = best
    try:
        CACHE.parent.mkdir(parents=True, exist_ok=True)
        CACHE.write_text(json.dumps(cache, indent=1))
    except OSError:
        pass
    return best


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, or '' where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""
