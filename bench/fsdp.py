"""FSDP2 sharding (``train.fsdp``) on one device with one rank: the same training as without it, and its memory.

The SFT job of ``bench/vs_trl.py`` (BBC articles -> headlines, completion-only loss, padding-free micro-batches)
with every weight training, fp32, AdamW (torch), clipping at 1.0, on a SmolLM2-135M-shaped causal LM (random init,
``bench/gpu_models.py smollm2``; ``--smoke``: a 2-layer hidden-64 one; ``--model DIR``: another), twice from the same
weights on the same micro-batches in the same order (the backend's seeded sampler), each through onegpu's own
training (:func:`onegpu.training.session.plan`, ``build_model`` and ``fit``: the accelerate backend):

- ``unsharded``: the plain run, as one process trains;
- ``sharded``: the same config with ``train.fsdp.enabled`` set after validation, inside a process group of world
  size 1 made here (``nccl`` on CUDA, ``gloo`` on a CPU; a TCP store on 127.0.0.1 at a free port; destroyed after).
  So the backend's own FSDP2 path runs, not a copy of it: ``sharding.shard`` (``fully_shard`` per block and the
  root, before the optimizer), ``sharding.gradient_sync`` over the micro-batches of gradient_accumulation_steps,
  ``sharding.global_norm`` of ``clip_grad_norm_``, and ``sharding.gather`` into ``sharding.meta_copy`` at the end.
  Validation refuses ``train.fsdp`` with ``train.num_processes`` below 2 on purpose (one process has nothing to
  shard: a user gains nothing); this bench sets the field on the validated config to check the code path on a
  device that has one GPU, and says so in its output.

One rank: FSDP2's reduce-scatter over a world of one is a copy, so this checks onegpu's sharded code path on the
device (DTensor parameters, gradients and AdamW states, the gathered weights), not the arithmetic of N ranks,
which the CPU suite proves in float64 over 2 gloo ranks (tests/unit/training/parallel/test_distributed.py).

Printed per optimizer step: each arm's loss, grad_norm and step time (s), the relative differences of the loss and
grad_norm; the gathered model's weights against the unsharded run's (max over tensors of max|a - b| / max|b|).
Memory per arm, **measured**: parameters, gradients and optimizer states (bytes, :func:`onegpu.measure.memory.
state_bytes` after step 1, which counts a DTensor's local storage: this rank's shards) and the peak per step, max
over the steps (CUDA: peak allocated memory, ``torch.cuda.max_memory_allocated``; a CPU: the process's resident
set, which holds both arms' leftovers: no figure of sharding). **Predicted** (:func:`onegpu.training.parallel.sharding.
per_rank_bytes`, no measurement): one rank's params, grads, optimizer states and gathered weights for N = 1 (to
set against the measured sharded arm) and N = 2, 4, 8 ranks (per rank memory where more GPUs exist).

Checks (each a line; exit 1 when one fails): the sharded arm ran; every loss finite; each step's loss and grad_norm
within :data:`RTOL` of the unsharded run's (expected within the float32 floor, about 1e-6); the gathered weights
within :data:`WEIGHT_RTOL`; the sharded arm's measured params, grads and optimizer bytes equal to the N = 1
prediction. A sharded arm that fails reports the unsharded arm's figures and its error line.
Results: ``bench/results/fsdp[-tag].{md,json}``.

Run: ``python -m bench.fsdp`` (``--smoke``: tiny sizes on any machine, a check of the script).
"""
from __future__ import annotations

import contextlib
import math
import os
import statistics
import time

ARMS = ("unsharded", "sharded")
# Largest relative per-step difference of the sharded arm's loss and grad_norm to the unsharded arm's: the float32
# floor is about 1e-6 (the sharded norm sums per-shard squares in another order); a wrong gradient sync or norm
# gives 1e-3 and more.
RTOL = 1e-5
# Largest relative difference of the gathered weights (max over tensors of max|a - b| / max|b|) after the steps:
# on the CPU the arms are equal to the bit; on CUDA non-deterministic kernels (the embedding's backward, SDPA's)
# move a gradient by ~1e-7, and AdamW turns a near-zero element's noise into an update of up to lr (1e-4) per
# step, so the bound is 1e-3; a gather that misplaces a shard moves weights by their own size.
WEIGHT_RTOL = 1e-3
RANKS = (1, 2, 4, 8)  # the per_rank_bytes predictions printed
STATES = ("mem_params_bytes", "mem_grads_bytes", "mem_optimizer_bytes")
# --smoke: the sizes (a 2-layer hidden-64 SmolLM2-shaped model where --model is not given)
SMOKE = {"max_length": 64, "rows": 16, "micro": 2, "accum": 2, "steps": 3}
SMOKE_MODEL = {"layers": 2, "hidden": 64, "heads": 2, "kv_heads": 1, "intermediate": 128}


def fsdp_cfg(args):
    """The SFT job's ``Config`` (:func:`bench.vs_trl.sft_cfg`): every weight, fp32 (``--bf16``: ``train.bf16``),
    AdamW, clipping 1.0, no validation, no OOM retry, the whole logits (``fused_lm_head`` false, as when the fused
    head was refused under ``train.fsdp``: the figures stay comparable with those recorded then)."""
    from bench.vs_trl import sft_cfg
    return sft_cfg(args, bf16=bool(args.bf16), optim="adamw_torch", max_grad_norm=1.0, fused_lm_head=False,
                   eval_strategy="no", oom_retry=False)


@contextlib.contextmanager
def one_rank(device_type: str):
    """A process group of world size 1 (``nccl`` for ``"cuda"``, else ``gloo``) on a TCP store at 127.0.0.1 and a
    free port; destroyed on exit."""
    import socket
    from datetime import timedelta

    import torch.distributed as dist
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=0, world_size=1, timeout=timedelta(seconds=120))
    try:
        yield
    finally:
        dist.destroy_process_group()


def predicted(model, args) -> dict[int, dict[str, int]]:
    """``{N: per_rank_bytes(...)}`` for N in :data:`RANKS` from the unsharded ``model`` (bytes, predicted)."""
    from onegpu.training.parallel import sharding
    return {n: sharding.per_rank_bytes(model, n, args.accum, "adamw_torch", not args.keep_gathered) for n in RANKS}


def train_arm(args, arm: str, dsd, tok) -> dict:
    """One training of ``arm`` (see the module docstring). Returns its per-step rows (loss, grad_norm, step time,
    peak), the recorder's memory, the trained weights (CPU tensors by name), the device and, for ``unsharded``, the
    per_rank_bytes predictions (:func:`predicted`) made from the model before training."""
    import torch

    from onegpu.config import FSDPConfig
    from onegpu.measure import memory
    from onegpu.training import session
    plan = session.plan(fsdp_cfg(args), {"fingerprint": "bench"})
    model, _ = session.build_model(plan.cfg, plan.model_path, plan.stats, tok)
    sharded = arm == "sharded"
    out = {"device": plan.device} if sharded else {"device": plan.device, "predicted": predicted(model, args)}
    if sharded:  # after validation, which refuses train.fsdp on one process (see the module docstring)
        plan.cfg.train.fsdp = FSDPConfig(enabled=True, reshard_after_forward=not args.keep_gathered)
    memory.reset_peak(plan.device)
    start = time.perf_counter()
    with one_rank("cuda" if memory.is_cuda(plan.device) else "cpu") if sharded else contextlib.nullcontext():
        trained, rec = session.fit(plan, model, tok, dsd, lambda metrics, step: None, checkpoints=False)
    out["wall_s"] = time.perf_counter() - start
    out["rows"] = [{k: r[k] for k in ("step", "loss", "grad_norm", "step_time_s", "mem_peak_bytes")}
                   for r in rec.rows]
    out["memory"] = rec.memory()
    out["weights"] = {n: p.detach().to("cpu", copy=True) for n, p in trained.named_parameters()}
    out["plain"] = not any(type(p).__name__ == "DTensor" for p in trained.parameters())
    del trained, model, rec
    memory.empty_cache()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out


def rel(a: float, b: float) -> float:
    """|a - b| / |b| (0 where both are 0)."""
    return abs(a - b) / abs(b) if b else (0.0 if a == b else math.inf)


def weight_distance(a: dict, b: dict) -> float:
    """Max over the tensors named in ``b`` of max|a - b| / max|b|; inf where ``a`` lacks one or its shape differs."""
    worst = 0.0
    for name, w in b.items():
        if name not in a or a[name].shape != w.shape:
            return math.inf
        worst = max(worst, float((a[name] - w).abs().max()) / max(float(w.abs().max()), 1e-30))
    return worst


def step_distance(runs: dict, key: str) -> float:
    """Largest relative difference of the sharded arm's per-step ``key`` to the unsharded arm's."""
    return max(rel(s[key], u[key]) for s, u in zip(runs["sharded"]["rows"], runs["unsharded"]["rows"]))


def checks(runs: dict, error: str | None) -> list[tuple[bool, str]]:
    """``(passed, sentence)`` for each check of the module docstring that the arms run allow."""
    out = [(error is None and "sharded" in runs, "the sharded arm ran" + (f": {error}" if error else ""))]
    out.append((all(math.isfinite(r["loss"]) for run in runs.values() for r in run["rows"]), "every loss is finite"))
    if error is not None or "sharded" not in runs:
        return out
    s, u = runs["sharded"], runs["unsharded"]
    out.append((len(s["rows"]) == len(u["rows"]), f"both arms ran {len(u['rows'])} optimizer steps"))
    for key in ("loss", "grad_norm"):
        d = step_distance(runs, key)
        out.append((d <= RTOL, f"{key}: every step within {d:.1e} of the unsharded run's (at most {RTOL:g})"))
    d = weight_distance(s["weights"], u["weights"])
    out.append((d <= WEIGHT_RTOL and s["plain"], f"gathered weights: a plain model within {d:.1e} of the unsharded "
                                                 f"run's (at most {WEIGHT_RTOL:g})"))
    got = {k: s["memory"].get(k) for k in STATES}
    want = {k: u["predicted"][1][k] for k in STATES}
    out.append((got == want, "measured params, grads and optimizer bytes of the sharded arm equal per_rank_bytes at "
                              f"N = 1 ({', '.join(f'{got[k]:,}' if got[k] is not None else '-' for k in STATES)})"))
    return out


def _mib(n) -> str:
    return "-" if n is None else f"{n / 2**20:,.2f}"


def peak(run: dict) -> int:
    """The run's peak per step, max over the steps (bytes: CUDA peak allocated, else the resident set)."""
    return max(r["mem_peak_bytes"] for r in run["rows"])


def step_rows(runs: dict) -> list[list]:
    """One row per optimizer step: loss, grad_norm and step time of each arm, the relative differences."""
    u = runs["unsharded"]["rows"]
    s = runs.get("sharded", {}).get("rows") or [None] * len(u)
    out = []
    for a, b in zip(u, s):
        out.append([a["step"], f"{a['loss']:.7f}", "-" if b is None else f"{b['loss']:.7f}",
                    "-" if b is None else f"{rel(b['loss'], a['loss']):.1e}", f"{a['grad_norm']:.6f}",
                    "-" if b is None else f"{b['grad_norm']:.6f}",
                    "-" if b is None else f"{rel(b['grad_norm'], a['grad_norm']):.1e}",
                    f"{a['step_time_s']:.3f}", "-" if b is None else f"{b['step_time_s']:.3f}"])
    return out


def memory_rows(runs: dict, pred: dict | None) -> list[list]:
    """Measured rows (each arm) then predicted rows (per_rank_bytes, each N of :data:`RANKS`), MiB."""
    rows = [[f"{arm} (measured)", *(_mib(r["memory"].get(k)) for k in STATES), "-", _mib(peak(r))]
            for arm, r in runs.items()]
    for n, p in (pred or {}).items():
        rows.append([f"sharded, N = {n} rank{'s' if n > 1 else ''} (predicted)", *(_mib(p[k]) for k in STATES),
                     _mib(p["mem_gathered_bytes"]), "-"])
    return rows


def setup_line(args, model: str, cuda: bool) -> str:
    """What ran, in one paragraph."""
    return (f"{model}, every weight, data.max_length {args.max_length}, padding-free, whole logits, {args.steps} "
            f"optimizer steps of {args.micro} x {args.accum} (micro-batch x gradient_accumulation_steps), "
            f"{'bf16 autocast' if args.bf16 else 'fp32'}, AdamW, lr {args.lr}, clipping 1.0; both arms through "
            "onegpu's accelerate backend from the same weights on the same micro-batches; sharded: "
            f"train.fsdp.enabled (reshard_after_forward {not args.keep_gathered}) in a process group of world size 1 "
            f"({'nccl' if cuda else 'gloo'}), set after validation (which refuses it on one process).")


def report_lines(args, runs: dict, model: str, error: str | None, load: list[float]) -> list[str]:
    """The Markdown: the setup, the per-step table, the memory table, the notes and the checks."""
    from onegpu.formatting import markdown_table
    u = runs["unsharded"]
    cuda = u["device"].startswith("cuda")
    times = {a: [r["step_time_s"] for r in run["rows"][1:]] for a, run in runs.items()}
    where = ("peak allocated memory (torch.cuda.max_memory_allocated)" if cuda else
             "the process's resident set (a CPU: both arms' leftovers in it, no figure of sharding)")
    return [setup_line(args, model, cuda), "",
            markdown_table(["step", "loss unsharded", "loss sharded", "rel. diff", "grad_norm unsharded",
                            "grad_norm sharded", "rel. diff", "step time unsharded (s)", "step time sharded (s)"],
                           step_rows(runs)), "",
            markdown_table(["per rank (MiB)", "params", "grads", "optimizer states", "gathered weights",
                            "peak per step, max over steps"], memory_rows(runs, u.get("predicted"))), "",
            *([f"Sharded arm failed: {error}", ""] if error else []),
            "One rank: FSDP2's reduce-scatter over a world of one is a copy, so this checks onegpu's sharded code "
            "path on this device (fully_shard, gradient sync under accumulation, the DTensor norm, the gather), not "
            "the arithmetic of N ranks, which the CPU suite proves in float64 over 2 gloo ranks. Measured: params, "
            "grads and optimizer states after step 1 (memory.state_bytes: a DTensor's local storage); peak per step: "
            f"{where}. Predicted: sharding.per_rank_bytes (gathered weights, predicted only: "
            + ("every block's, reshard_after_forward false" if args.keep_gathered else
               "the two largest blocks' and the root's") + "). Steady step time (steps 2..N, median): "
            + ", ".join(f"{a} {statistics.median(t):.3f} s" for a, t in times.items() if t)
            + f". Load average during the run: {min(load):.2f}-{max(load):.2f} ({os.cpu_count()} cores).", "",
            *[f"- {'passed' if ok else '**FAILED**'}: {text}" for ok, text in checks(runs, error)]]


def payload(runs: dict, error: str | None) -> dict:
    """The JSON: each arm without its weights, the error line, the checks."""
    return {"runs": {a: {k: v for k, v in r.items() if k != "weights"} for a, r in runs.items()}, "error": error,
            "checks": [{"passed": ok, "check": text} for ok, text in checks(runs, error)]}


def _data(args):
    """The SFT job's prepared rows and the model's tokenizer."""
    from onegpu.data import pipeline
    from onegpu.models import loader
    path = loader.resolve_model_path(args.model)
    dsd, tok, _, _ = pipeline.prepare(fsdp_cfg(args), "prompt-completion",
                                      lambda texts: loader.load_tokenizer(path, "causal-lm"))
    return dsd, tok, path


def run(args) -> tuple[dict, str | None, list[float]]:
    """Both arms, unsharded first: ``(runs, error line of the sharded arm or None, load averages)``."""
    dsd, tok, _ = _data(args)
    load = [os.getloadavg()[0]]
    runs = {"unsharded": train_arm(args, "unsharded", dsd, tok)}
    load.append(os.getloadavg()[0])
    error = None
    try:
        runs["sharded"] = train_arm(args, "sharded", dsd, tok)
    except Exception as e:  # the unsharded arm's figures are still reported
        error = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    load.append(os.getloadavg()[0])
    return runs, error, load


def main() -> int:
    from bench import environment
    p = environment.parser(__doc__.splitlines()[0], reps=1, steps=4, max_length=1024, rows=64, micro=4, accum=2)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--model", default=None, help="a causal LM directory (default: a SmolLM2-135M-shaped one, random "
                                                 "init, written to a temporary folder; --smoke: a 2-layer one)")
    p.add_argument("--keep-gathered", action="store_true", help="train.fsdp.reshard_after_forward false")
    p.add_argument("--smoke", action="store_true", help=f"tiny sizes: {SMOKE}")
    args = p.parse_args()
    args.lora = 0
    if args.smoke:
        vars(args).update(SMOKE)
    tmp = environment.setup()
    from bench import gpu_models
    from bench.reporting import report
    from bench.vs_trl import model_name
    if args.model is None:
        args.model = str(gpu_models.write_smollm2(tmp / "smollm2", **(SMOKE_MODEL if args.smoke else {})))
    runs, error, load = run(args)
    if error:
        print(f"fsdp: the sharded arm failed: {error}", flush=True)
    report("fsdp", args, __doc__.splitlines()[0], report_lines(args, runs, model_name(args, args.model), error, load),
           payload(runs, error))
    return 0 if all(ok for ok, _ in checks(runs, error)) else 1


if __name__ == "__main__":
    raise SystemExit(main())
