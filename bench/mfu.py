"""MFU of a GPT-2 124 M training step at 1024 tokens in bf16, with and without ``torch.compile``.

The figure nanoGPT (``estimate_mfu``) and llm.c report: model FLOPs per token ``6 N + 12 n_layer d_model T``
(:func:`onegpu.measure.flops.flops_per_token`: ``N`` the weights applied per token, the tied unembedding
included, embedding lookups not; the attention term PaLM's ``12 L H Q T``) times tokens per second,
against the device's dense bf16 peak (:func:`onegpu.measure.flops.device_peak`: the datasheet's 989 TFLOP/s
for an H100/H200) and against a bf16 matmul rate measured in the same process (8192^3 products on a
GPU), which is what the chip sustains here.

Setup (as nanoGPT's ``train.py``): ``transformers.GPT2LMHeadModel`` from ``GPT2Config`` (12 layers,
hidden 768, 12 heads, vocabulary 50257, context 1024: 124 M parameters, random init, seed 0), SDPA
attention, dropout 0, fp32 weights with bf16 autocast, AdamW (fused on CUDA), TF32 allowed, micro-batch
``--batch`` sequences of ``--seq`` random token ids (the same batches for both arms). Each arm builds its
model afresh; step 1 (compilation) is timed apart, then ``--warmup`` steps, then ``--steps`` timed
steps, each ended by a device synchronisation. Both arms log the loss of every step, so the table shows
how far compiled and eager runs of the same training differ.

Run as ``python -m bench.mfu`` from the repository root (``--help`` for the sizes); writes
``bench/results/mfu[-TAG].{json,md}`` (``--out`` for another folder) and prints the table.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path

from onegpu.formatting import gib, markdown_table, ratio

RESULTS = Path(__file__).resolve().parent / "results"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.mfu", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--seq", type=int, default=1024, help="tokens per sequence (the context)")
    p.add_argument("--batch", type=int, default=16, help="sequences per optimizer step")
    p.add_argument("--steps", type=int, default=10, help="timed optimizer steps per arm")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps after step 1")
    p.add_argument("--arms", default="eager,compile", help="comma-separated: eager, compile")
    p.add_argument("--fp32", action="store_true", help="no bf16 autocast (plain fp32)")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--out", type=Path, default=RESULTS, help="folder for mfu[-TAG].json/.md")
    p.add_argument("--tag", default="", help="suffix of the result files")
    p.add_argument("--note", action="append", default=[], help="a line added to the report (repeatable)")
    return p.parse_args(argv)


def build(args, device: str):
    """The GPT-2 of ``args``' sizes, random init (seed 0), on ``device``."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=args.layers, n_embd=args.hidden, n_head=args.heads, vocab_size=args.vocab,
                     n_positions=args.seq, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     bos_token_id=min(50256, args.vocab - 1), eos_token_id=min(50256, args.vocab - 1))
    cfg._attn_implementation = "sdpa"
    return GPT2LMHeadModel(cfg).to(device)


def batches(args, n: int):
    """``n`` micro-batches of random token ids, ``(batch, seq)`` int64 on the CPU, from a fixed seed."""
    import torch
    g = torch.Generator().manual_seed(1234)
    return [torch.randint(0, args.vocab, (args.batch, args.seq), generator=g) for _ in range(n)]


def _sync(device: str) -> None:
    import torch
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_arm(args, device: str, compiled: bool, data) -> dict:
    """One arm: step 1 timed apart, ``warmup`` untimed, ``steps`` timed; per-step losses and times."""
    import torch
    model = build(args, device)
    fwd = torch.compile(model) if compiled else model
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, fused=device.startswith("cuda"))
    dtype = torch.float32 if args.fp32 else torch.bfloat16
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    losses, times = [], []
    for x in data:
        x = x.to(device, non_blocking=True)
        t0 = time.perf_counter()
        with torch.autocast(device_type=device.split(":")[0], dtype=dtype, enabled=not args.fp32):
            loss = fwd(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    timed = times[1 + args.warmup:]
    from onegpu.measure.flops import flops_per_token
    peak_mem = torch.cuda.max_memory_allocated() if device.startswith("cuda") else None
    return {"arm": "compile" if compiled else "eager", "step1_s": times[0], "step_times_s": times,
            "median_step_s": statistics.median(timed), "tokens_per_step": args.batch * args.seq,
            "flops_per_token": flops_per_token(model, args.seq), "losses": losses, "peak_mem_bytes": peak_mem,
            "params": sum(p.numel() for p in model.parameters())}


def matmul_rate(device: str, dtype_name: str) -> float:
    """A measured dense matmul rate (FLOP/s): mean of 10 products of n x n (8192 on a GPU, 1024 on a CPU)
    after 3 warm-ups, as the device guide's figure was taken."""
    import torch
    n = 8192 if device.startswith("cuda") else 1024
    dtype = torch.float32 if dtype_name == "fp32" else torch.bfloat16
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(10):
        a @ b
    _sync(device)
    return 10 * 2 * n**3 / (time.perf_counter() - t0)


def machine(device: str) -> dict:
    import torch
    import transformers
    cuda = device.startswith("cuda")
    return {"device": torch.cuda.get_device_name(0) if cuda else (platform.processor() or platform.machine()),
            "gpu_memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30) if cuda else None,
            "torch": torch.__version__, "cuda": torch.version.cuda if cuda else None,
            "python": platform.python_version(), "transformers": transformers.__version__,
            "date": datetime.date.today().isoformat()}


def summarise(r: dict, peak: dict, measured: float) -> dict:
    """Tokens/s, model FLOP/s and MFU (datasheet or onegpu's peak; the measured matmul rate) of one arm."""
    tps = r["tokens_per_step"] / r["median_step_s"]
    achieved = tps * r["flops_per_token"]
    return {**r, "tokens_per_second": tps, "model_flops_per_second": achieved,
            "mfu": achieved / peak["peak"] if peak["peak"] else None, "mfu_vs_measured": achieved / measured}


def markdown(args, m: dict, rows: list[dict], peak: dict, measured: float) -> str:
    dev = f"{m['device']}" + (f" ({m['gpu_memory_gib']} GiB), CUDA {m['cuda']}" if m["cuda"] else ", no GPU")
    head = ["arm", "median step", "tokens/s", "model TFLOP/s", f"MFU ({peak['source']} peak "
            f"{peak['peak'] / 1e12:.3g} TFLOP/s)", f"MFU vs measured matmul ({measured / 1e12:.3g} TFLOP/s)",
            "step 1 (compile)", "peak memory", "loss step 1 / last"]
    lines = [f"### MFU: GPT-2 {rows[0]['params'] / 1e6:.3g} M parameters, {args.seq} tokens, "
             f"{'fp32' if args.fp32 else 'bf16 autocast'}", "",
             f"Device: {dev}; torch {m['torch']}, Python {m['python']}, transformers {m['transformers']}; "
             f"{m['date']}", "",
             f"`python -m bench.mfu`: {args.layers} layers, hidden {args.hidden}, {args.heads} heads, vocabulary "
             f"{args.vocab}, micro-batch {args.batch} x {args.seq} tokens, {args.steps} timed steps after step 1 "
             f"and {args.warmup} warm-up; random init; model FLOPs {rows[0]['flops_per_token'] / 1e6:,.3g} M per "
             "token (6N + 12 L d T).", ""]
    cells = [[r["arm"], f"{r['median_step_s'] * 1e3:.1f} ms", f"{r['tokens_per_second']:,.0f}",
              f"{r['model_flops_per_second'] / 1e12:.3g}", "n/a" if r["mfu"] is None else f"{r['mfu']:.1%}",
              f"{r['mfu_vs_measured']:.1%}", f"{r['step1_s']:.1f} s", gib(r["peak_mem_bytes"], missing="n/a"),
              f"{r['losses'][0]:.4f} / {r['losses'][-1]:.4f}"] for r in rows]
    lines.append(markdown_table(head, cells))
    return "\n".join(lines + [""] + notes(args, rows)) + "\n"


def notes(args, rows: list[dict]) -> list[str]:
    out = [f"- {n}" for n in args.note]
    by = {r["arm"]: r for r in rows}
    if "eager" in by and "compile" in by:
        e, c = by["eager"], by["compile"]
        diff = max(abs(a - b) / abs(a) for a, b in zip(e["losses"], c["losses"]))
        out.append(f"- torch.compile / eager: **{ratio(e['median_step_s'] / c['median_step_s'])}** the tokens/s; "
                   f"largest relative loss difference over the {len(e['losses'])} steps of the same training: "
                   f"{diff:.2e} (bf16 autocast rounds differently in fused kernels).")
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    import torch

    from onegpu.measure import flops
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    dtype_name = "fp32" if args.fp32 else "bf16"
    data = batches(args, 1 + args.warmup + args.steps)
    m = machine(device)
    peak_value, source = flops.device_peak(m["device"], dtype_name, device)
    peak = {"peak": peak_value, "source": source}
    measured = matmul_rate(device, dtype_name)
    rows = []
    for arm in [a.strip() for a in args.arms.split(",") if a.strip()]:
        rows.append(summarise(run_arm(args, device, arm == "compile", data), peak, measured))
        print(f"mfu: {arm}: median step {rows[-1]['median_step_s'] * 1e3:.1f} ms, MFU "
              f"{rows[-1]['mfu'] or 0:.1%} ({source} peak)", flush=True)
    md = markdown(args, m, rows, peak, measured)
    print("\n" + md)
    stem = f"mfu-{args.tag}" if args.tag else "mfu"
    args.out.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": "mfu", "machine": m, "args": {k: str(v) for k, v in vars(args).items()},
               "peak": peak, "measured_matmul_flops": measured, "arms": rows}
    (args.out / f"{stem}.json").write_text(json.dumps(payload, indent=1) + "\n")
    (args.out / f"{stem}.md").write_text(md)
    print(f"wrote {args.out / stem}.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
