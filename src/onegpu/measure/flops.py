"""Model FLOPs and MFU (model FLOPs utilisation), and a finished training's speed in both (:func:`speed_metrics`).

Training FLOPs per run (:func:`train_flops`): ``6 * N_tok * tokens + 12 * n_layer * d_model * sum(t_i^2) +
6 * N_seq * examples`` over non-padding lengths ``t_i``, frozen (LoRA) weights counted without the gradients
they do not need (:func:`matmul_counts`); the device peak from datasheets (:data:`PEAKS`) or measured
(:func:`measured_peak`). The counts, their sources and the peak's rules: docs/details.md, "Model FLOPs and MFU".
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

CACHE_ENV = "ONEGPU_CACHE_DIR"
CACHE_NAME = "peak_flops.json"
METHOD = "thread-cpu-time-v2"  # cache entries of another method (the old wall-clock one) are ignored


def cache_file() -> Path:
    """Where measured peaks are cached: ``$ONEGPU_CACHE_DIR/peak_flops.json``, else
    ``$XDG_CACHE_HOME/onegpu/peak_flops.json``, else ``~/.cache/onegpu/peak_flops.json`` (read at call
    time, so tests can point it elsewhere)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]) / CACHE_NAME
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "onegpu" / CACHE_NAME


def display_path(path: Path) -> str:
    """``path`` with the home directory written as ``~`` (no user name in params or tags)."""
    try:
        return "~/" + str(Path(path).relative_to(Path.home()))
    except ValueError:
        return str(path)


def _embedding_weights(model) -> set[int]:
    import torch
    return {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}


def _unique_numel(params, skip: set[int] = frozenset()) -> tuple[int, set[int]]:
    seen, n = set(), 0
    for p in params:
        if id(p) not in seen and id(p) not in skip:
            seen.add(id(p))
            n += p.numel()
    return n, seen


def _unwrap(model):
    """``(transformers model, ids of parameters that never run)``: a ``peft.PeftModel`` gives its base
    model (adapters injected, same parameters); a ``ModulesToSaveWrapper`` (peft's trainable copy of a
    classification head) runs its copy, never its ``original_module``, whose parameters are left out."""
    inner = model.get_base_model() if hasattr(model, "peft_config") and hasattr(model, "get_base_model") else model
    idle: set[int] = set()
    for m in inner.modules():
        if hasattr(m, "original_module") and hasattr(m, "modules_to_save"):
            idle |= {id(p) for p in m.original_module.parameters()}
    return inner, idle


def non_embedding_parameters(model) -> int:
    """Parameters outside embedding tables (``nn.Embedding`` weights), counted once."""
    return _unique_numel(model.parameters(), _embedding_weights(model))[0]


def _roles(model) -> list[tuple[str, int, bool, bool]]:
    """Every matmul parameter once, in registration order: ``(role "tok" | "seq", numel, trainable,
    needs input gradient)``. See :func:`matmul_counts` for the rules."""
    import torch
    inner, idle = _unwrap(model)
    emb = _embedding_weights(inner)
    order = [p for p in dict.fromkeys(inner.parameters()) if id(p) not in idle]
    out = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    unembed = out.weight if out is not None and getattr(out, "weight", None) is not None else None
    per_seq: set[int] = set()
    if unembed is None:  # a sequence classifier: the head outside base_model and the pooler run per sequence
        base = getattr(inner, "base_model", inner)
        if base is not inner:
            in_base = {id(p) for p in base.parameters()}
            per_seq |= {id(p) for p in inner.parameters() if id(p) not in in_base}
        pooler = getattr(base, "pooler", None)
        if isinstance(pooler, torch.nn.Module):
            per_seq |= {id(p) for p in pooler.parameters()}
    # Registration order is the order transformers' models run their layers in; the unembedding runs last.
    first = next((i for i, p in enumerate(order) if p.requires_grad), len(order) + 1)
    rows = [("seq" if id(p) in per_seq else "tok", p.numel(), p.requires_grad, i > first)
            for i, p in enumerate(order) if id(p) not in emb]
    if unembed is not None and (id(unembed) in emb or all(q is not unembed for q in order)):
        # tied to the input embedding (left out above as a lookup): the d_model x vocab matmul still runs
        rows.append(("tok", unembed.numel(), unembed.requires_grad, len(order) > first))
    return rows


def matmul_counts(model) -> dict[str, int]:
    """Parameter counts behind each part of a training step's model FLOPs (see the module docstring).

    ``tok`` / ``seq``: weights applied per token / per sequence (:func:`matmul_parameters`), each
    costing 2 FLOPs per use in the forward pass. ``tok_weight_grad`` / ``seq_weight_grad``: those that
    train (``requires_grad``), whose weight gradient costs 2 more. ``tok_input_grad`` /
    ``seq_input_grad``: those whose *input* gradient is needed, 2 more: every weight registered after
    the model's first trainable parameter (embedding tables included in that search; registration
    order is the forward order of transformers' layers), because the gradient has to flow through
    them back to a trainable one; the weights before it, and the first trainable one itself, read
    inputs that need no gradient. Full fine-tuning (the token embedding trains): every weight, 6 N.
    Under LoRA with frozen base weights: a frozen weight costs 4 (forward + input gradient) and 2 before
    the first adapter; an adapter 6 (its ``lora_A`` 4: its input is the layer's, which needs none when
    it is the first). Weights that run beside the first adapter on the same input (with adapters on
    BERT's ``query``: layer 0's ``key``/``value``) are counted with an input gradient they do not need:
    at most a few d_model^2 per token, in one layer. A ``peft.PeftModel`` is counted through its base
    model; the frozen ``original_module`` of a head that peft trains as a copy never runs and is left out.
    Returns:
        Parameter counts (int) under the keys ``tok``, ``tok_input_grad``, ``tok_weight_grad``, ``seq``,
        ``seq_input_grad``, ``seq_weight_grad``.
    """
    counts = dict.fromkeys(("tok", "tok_input_grad", "tok_weight_grad", "seq", "seq_input_grad",
                            "seq_weight_grad"), 0)
    for role, n, trains, input_grad in _roles(model):
        counts[role] += n
        counts[f"{role}_weight_grad"] += n if trains else 0
        counts[f"{role}_input_grad"] += n if input_grad else 0
    return counts


def matmul_parameters(model) -> tuple[int, int]:
    """``(N_tok, N_seq)``: weights applied per token and per sequence (see the module docstring).

    * A model with output embeddings (a language model's ``lm_head``): ``N_tok`` = every parameter
      except embedding lookups, plus the output projection's weight once even when tied to the input
      embedding; ``N_seq`` = 0.
    * Otherwise (a sequence classifier): parameters outside ``model.base_model`` (the head) and the base
      model's ``pooler`` (if any) run once per sequence and form ``N_seq``; the rest, embedding lookups
      left out, is ``N_tok``.
    Shared tensors count once; a ``peft.PeftModel`` counts its base model with the adapters (see
    :func:`matmul_counts`). Returns parameter counts (int).
    """
    c = matmul_counts(model)
    return c["tok"], c["seq"]


def _layers_width(model) -> tuple[int, int]:
    """(layers, attention width): the width of the query heads (``num_attention_heads x head_dim``) where
    the config gives a ``head_dim`` (Llama, whose grouped-query attention still scores every query head
    against its shared key), else the hidden size."""
    cfg = model.config
    n_layer = getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layer", 0)
    d_model = getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd", 0)
    heads, head_dim = getattr(cfg, "num_attention_heads", None), getattr(cfg, "head_dim", None)
    if isinstance(heads, int) and isinstance(head_dim, int):
        d_model = heads * head_dim
    return int(n_layer), int(d_model)


def train_flops(model, examples: int, tokens: int, tokens_sq: int | None = None) -> float:
    """Model FLOPs to train on ``examples`` sequences of ``tokens`` non-padding tokens in all (forward +
    backward, no recomputation), see the module docstring:
    ``2 (N_tok + N_tok_input_grad + N_tok_weight_grad) tokens + 12 n_layer d_model sum(t_i^2)
    + 2 (N_seq + N_seq_input_grad + N_seq_weight_grad) examples`` (:func:`matmul_counts`), which is
    ``6 N_tok tokens + 12 n_layer d_model sum(t_i^2) + 6 N_seq examples`` when every weight trains.

    Args:
        tokens_sq: ``sum(t_i^2)`` over the examples' non-padding lengths ``t_i``; None assumes equal
            lengths (``tokens^2 / examples``).
    Returns:
        FLOPs (float).
    """
    if tokens_sq is None:
        tokens_sq = tokens * tokens / examples if examples else 0
    c = matmul_counts(model)
    per_token = 2.0 * (c["tok"] + c["tok_input_grad"] + c["tok_weight_grad"])
    per_sequence = 2.0 * (c["seq"] + c["seq_input_grad"] + c["seq_weight_grad"])
    n_layer, d_model = _layers_width(_unwrap(model)[0])
    return per_token * tokens + 12.0 * n_layer * d_model * tokens_sq + per_sequence * examples


def flops_per_token(model, seq_len: float) -> float:
    """Model FLOPs per trained token for sequences of ``seq_len`` non-padding tokens each:
    ``6 N_tok + 12 n_layer d_model seq_len + 6 N_seq / seq_len`` (:func:`train_flops` per token)."""
    return train_flops(model, 1, seq_len, seq_len * seq_len) / seq_len


def matmul_dtype(mixed_precision: str) -> str:
    """The dtype of the matmuls (a key of :data:`PEAKS`' entries) for ``train.mixed_precision``
    (:attr:`onegpu.config.TrainConfig.mixed_precision`): ``"bf16"``, ``"fp16"``, or ``"fp32"`` for ``"no"``."""
    return {"bf16": "bf16", "fp16": "fp16", "no": "fp32"}[mixed_precision]


def device_peak(device_name: str, dtype: str, device: str = "cpu", refresh: bool = False) -> tuple[float, str]:
    """Peak FLOP/s of ``device_name`` in ``dtype`` and where it came from ("datasheet" or "measured").

    On CUDA with fp32 and TF32 matmuls allowed, the tf32 peak is used. ``refresh`` measures an unlisted
    device again (the cache keeps the larger value).
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
    return measured_peak(device, dtype, refresh=refresh), "measured"


def _cache_key(device: str, dtype: str, threads: int) -> str:
    return f"{platform.machine()}|{cpu_model()}|{device}|{threads}|{dtype}|{METHOD}"


def read_cache() -> dict:
    """The peak cache as a dict (empty when missing or unreadable)."""
    try:
        data = json.loads(cache_file().read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def measured_peak(device: str, dtype: str, refresh: bool = False, seconds: float = 0.4) -> float:
    """Peak matmul FLOP/s of this machine's ``device`` in ``dtype``, cached per machine.

    On CPU the peak is measured so that load from other processes cannot lower it: one thread runs
    repeated 512 x 512 matmuls (``2 * 512^3`` FLOPs each) timed by that thread's own CPU time
    (``time.thread_time``: time it was descheduled is not counted), and the best rate is multiplied by
    the thread count PyTorch trains with (``torch.get_num_threads()``), i.e. perfect scaling, an upper
    bound (quiet against loaded, and against wall-clock timing: ``bench/results/measured_notes.md``). On
    CUDA the rate is timed by wall clock after ``torch.cuda.synchronize``.

    The cache (:func:`cache_file`) holds per machine, device, thread count and dtype the largest value
    ever measured, the time of that measurement and the number of measurements: a value is never
    replaced by a smaller one, so one measurement on a busy machine cannot stick. ``refresh`` measures
    again even when a value is cached.

    Returns:
        FLOP/s (float).
    """
    import torch
    threads = torch.get_num_threads()
    key = _cache_key(device, dtype, threads)
    cache = read_cache()
    entry = cache.get(key) if isinstance(cache.get(key), dict) else None
    if entry and not refresh:
        return float(entry["peak_flops"])
    value = _measure(device, dtype, threads, seconds)
    best = max(value, float(entry["peak_flops"])) if entry else value
    cache[key] = {"peak_flops": best, "last_measured": value,
                  "measured_at": entry["measured_at"] if entry and best > value else _now(),
                  "last_measured_at": _now(), "measurements": (entry or {}).get("measurements", 0) + 1,
                  "machine": f"{cpu_model() or platform.processor()} ({platform.machine()}), {threads} threads",
                  "method": METHOD}
    try:
        path = cache_file()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass
    return best


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _measure(device: str, dtype: str, threads: int, seconds: float) -> float:
    import torch
    tdtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    cuda = device.startswith("cuda")
    size = 2048 if cuda else 512
    # Constant inputs: matmul speed does not depend on the values, and the global RNG stays untouched.
    a = torch.full((size, size), 0.5, device=device, dtype=tdtype)
    b = torch.full((size, size), 0.25, device=device, dtype=tdtype)
    flop = 4 * 2 * size**3
    if cuda:
        a @ b
        torch.cuda.synchronize()
        best, end = 0.0, time.perf_counter() + seconds
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            for _ in range(4):
                a @ b
            torch.cuda.synchronize()
            best = max(best, flop / (time.perf_counter() - t0))
        return best
    torch.set_num_threads(1)
    try:
        a @ b  # warm-up
        best, end = 0.0, time.perf_counter() + seconds
        while time.perf_counter() < end:
            t0 = time.thread_time()
            for _ in range(4):
                a @ b
            dt = time.thread_time() - t0
            if dt > 0:
                best = max(best, flop / dt)
    finally:
        torch.set_num_threads(threads)
    return best * threads


def mfu(achieved: float, device_name: str, dtype: str, device: str = "cpu") -> dict:
    """MFU of ``achieved`` model FLOP/s against the device's peak, never above 1.

    An MFU above 1 against a *measured* peak means the peak is too low: it is measured again (the cache
    keeps the larger value). If the MFU is still above 1, or the peak is a datasheet figure, no MFU is
    given and ``unknown_reason`` says why.

    Returns:
        ``{"mfu": float in (0, 1] or None, "peak": FLOP/s, "source": "datasheet" | "measured",
        "remeasured": bool, "unknown_reason": str or None}``.
    """
    peak, source = device_peak(device_name, dtype, device)
    remeasured = False
    if source == "measured" and achieved > peak:
        peak, source = device_peak(device_name, dtype, device, refresh=True)
        remeasured = True
    if peak > 0 and achieved <= peak:
        return {"mfu": achieved / peak, "peak": peak, "source": source, "remeasured": remeasured,
                "unknown_reason": None}
    reason = (f"achieved {achieved:.4g} model FLOP/s is above the {source} peak of {peak:.4g} FLOP/s "
              f"({device_name}, {dtype}" + (", measured twice" if remeasured else "") + "): the peak is "
              "unknown, so no MFU is given")
    return {"mfu": None, "peak": peak, "source": source, "remeasured": remeasured, "unknown_reason": reason}


def speed_metrics(model, summary: dict, num_processes: int, mixed_precision: str, device: str,
                  device_name: str, tokens_sq: int | None = None) -> tuple[dict, dict, dict]:
    """A finished training's ``train_flops_per_second`` (model FLOPs, :func:`train_flops`; all processes
    together) and ``train_mfu`` against the device's peak in the matmul dtype of ``mixed_precision``
    (``train.mixed_precision``; each of ``num_processes`` processes on its own device of the same peak);
    ``model_flops_per_token`` and ``device_peak_flops`` with them.

    ``summary``: the recorder's totals (``train_samples``, ``train_tokens``, ``train_runtime`` in s);
    ``tokens_sq``: see :func:`train_flops`.
    Returns ``(metrics, params, tags)``: params name the peak's source and, for a measured peak, its
    cache file; with no trustworthy peak ``train_mfu`` is left out and the tag
    ``train_mfu.unknown_reason`` says why. Empty dicts when nothing was trained.
    """
    if not summary.get("train_samples") or not summary.get("train_runtime"):
        return {}, {}, {}
    total = train_flops(model, summary["train_samples"], summary["train_tokens"], tokens_sq)
    achieved = total / summary["train_runtime"]  # over all processes (their examples are summed)
    m = mfu(achieved / num_processes, device_name, matmul_dtype(mixed_precision), device)
    metrics = {"train_flops_per_second": achieved, "model_flops_per_token": total / summary["train_tokens"],
               "device_peak_flops": m["peak"]}
    params = {"device_peak_flops.source": m["source"]}
    if m["source"] == "measured":
        params["device_peak_flops.cache"] = display_path(cache_file())
    tags = {}
    if m["mfu"] is None:
        tags["train_mfu.unknown_reason"] = m["unknown_reason"]
    else:
        metrics["train_mfu"] = m["mfu"]
    return metrics, params, tags


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
