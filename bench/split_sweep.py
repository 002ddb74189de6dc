"""The split sweep: one effective batch (64) as micro-batch x accumulation = 64x1, 16x4, 4x16, 1x64.

Each split trains the same model init, data and config with ``onegpu.training.session.fit``
(metrics sink a no-op) for a few optimizer steps of the same effective batch. Reported per split:
samples/s and median step time over steps 2..N (step 1 is warm-up; median over repetitions),
``train_mem_peak_bytes`` (max over steps: CUDA allocator peak on GPU, process RSS peak on CPU) and
``mem_activation_bytes`` (bytes saved for backward by one micro-batch). A split that runs out of memory
is reported as OOM ("as far as memory allows"). The verdict: does 4x16 beat 1x64, and by what factor.

Splits run from the smallest micro-batch to the largest, with freed memory handed back to the system
between runs (``malloc_trim``), so that on CPU an earlier, larger run's heap does not inflate a later
run's RSS peak.
"""
from __future__ import annotations

import common


def parse_split(s: str) -> tuple[int, int]:
    m, a = s.lower().split("x")
    return int(m), int(a)


def main() -> None:
    p = common.parser(__doc__.splitlines()[0], reps=2, steps=3, rows=200)
    p.add_argument("--splits", default="64x1,16x4,4x16,1x64", help="micro x accumulation, comma-separated")
    p.add_argument("--layers", type=int, default=None,
                   help="use a BERT built from the MiniLM config with this many layers (random init) "
                        "instead of the pretrained MiniLM-L6")
    p.add_argument("--hidden", type=int, default=None, help="hidden size of that BERT (default 384)")
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing on for every split")
    args = p.parse_args()
    common.setup()
    import torch

    splits = [parse_split(s) for s in args.splits.split(",") if s.strip()]
    effs = {m * a for m, a in splits}
    cfgs = {s: common.make_cfg(args, micro=s[0], accum=s[1], checkpointing=args.checkpointing) for s in splits}
    dsd, labels, tok, path = common.data(next(iter(cfgs.values())))
    need = max(effs) * args.steps
    if len(dsd["train"]) < need:
        print(f"note: {len(dsd['train'])} training rows < {need} (effective batch x steps): the data wraps "
              "around and the epoch's last step may be partial")
    common.warm_up(args)

    def build(cfg):
        if args.layers:
            return common.bert_from_config(cfg, labels, path, args.layers, args.hidden)
        return common.pretrained_model(cfg, labels, path)

    probe = build(next(iter(cfgs.values())))
    model_name = ("MiniLM-L6 (pretrained), " if not args.layers else "from config, random init, ") \
        + common.describe_model(probe)
    del probe

    runs: dict = {s: [] for s in splits}
    order = sorted(splits, key=lambda s: (s[0], -s[1]))  # smallest micro-batch first
    for rep in range(args.reps):
        for s in (order if rep % 2 == 0 else order[::-1]):
            cfg = cfgs[s]

            def one(cfg=cfg):
                try:
                    return common.train_once(build(cfg), tok, dsd, cfg, verbose=args.verbose)
                except (torch.OutOfMemoryError, RuntimeError) as e:
                    if not common.is_oom(e):
                        raise
                    common.release_memory()
                    return {"oom": True}
            res = common.clean_run(one, args, f"{s[0]}x{s[1]}")
            runs[s].append(res)
            if res.get("oom"):
                print(f"{s[0]}x{s[1]} rep {rep + 1}: out of memory", flush=True)
                continue
            print(f"{s[0]}x{s[1]} rep {rep + 1}/{args.reps}: {res['samples_per_second']:.2f} samples/s, "
                  f"median step {res['median_step_s']:.3f} s, peak {common.mib(res['summary']['train_mem_peak_bytes'])}, "
                  f"activations {common.mib(res['memory'].get('mem_activation_bytes'))}", flush=True)

    agg = {}
    for s in splits:
        ok = [r for r in runs[s] if not r.get("oom")]
        agg[s] = {"oom": not ok,
                  "samples_per_second": common.median(r["samples_per_second"] for r in ok),
                  "median_step_s": common.median(r["median_step_s"] for r in ok),
                  "train_mem_peak_bytes": common.median(r["summary"]["train_mem_peak_bytes"] for r in ok),
                  "mem_activation_bytes": common.median(r["memory"].get("mem_activation_bytes") for r in ok),
                  "tokens_per_second": common.median(
                      sum(x["tokens"] for x in r["rows"][1:]) / sum(x["step_time_s"] for x in r["rows"][1:])
                      for r in ok if len(r["rows"]) > 1)}
    best = max((s for s in splits if not agg[s]["oom"]), key=lambda s: agg[s]["samples_per_second"], default=None)
    peak_name = "peak memory (CUDA allocator)" if torch.cuda.is_available() else "peak RSS (process)"
    rows = []
    for s in splits:
        a = agg[s]
        if a["oom"]:
            rows.append([f"{s[0]} x {s[1]}", "OOM", "", "", "", "", ""])
            continue
        rel = a["samples_per_second"] / agg[best]["samples_per_second"]
        rows.append([f"{s[0]} x {s[1]}", f"{a['samples_per_second']:.2f}", f"{rel:.2f}",
                     f"{a['median_step_s']:.3f} s", f"{a['tokens_per_second']:,.0f}",
                     common.mib(a["train_mem_peak_bytes"]), common.mib(a["mem_activation_bytes"])])
    prec = "bf16 mixed precision" if args.bf16 else "float32"
    lines = [
        f"`bench/split_sweep.py`: {model_name}, effective batch {'/'.join(map(str, sorted(effs)))}, "
        f"max_length {args.max_length}, {prec}, checkpointing {'on' if args.checkpointing else 'off'}, "
        f"{args.steps} optimizer steps per split, {args.reps} repetition(s), step 1 excluded.",
        "",
        common.table(["micro-batch x accumulation", "samples/s", "vs best", "median step time",
                      "tokens/s (non-padding)", peak_name, "mem_activation_bytes (one micro-batch)"], rows),
        "",
    ]
    verdict = None
    a, b = (4, 16), (1, 64)
    if a in agg and b in agg and not agg[a]["oom"] and not agg[b]["oom"]:
        f = agg[a]["samples_per_second"] / agg[b]["samples_per_second"]
        mem = agg[a]["train_mem_peak_bytes"] / agg[b]["train_mem_peak_bytes"]
        verdict = {"4x16_over_1x64": f, "4x16_peak_over_1x64": mem}
        lines.append(f"- 4 x 16 {'beats' if f > 1 else 'does not beat'} 1 x 64: **{f:.2f}x** the samples/s, at "
                     f"{mem:.2f}x the peak memory and "
                     f"{agg[a]['mem_activation_bytes'] / agg[b]['mem_activation_bytes']:.1f}x the activation bytes "
                     "per micro-batch.")
    if best:
        lines.append(f"- Fastest split here: {best[0]} x {best[1]}.")
    lines.append(f"- {common.load_note([r for v in runs.values() for r in v])}")
    common.report("split_sweep", args, "Split sweep: one effective batch, four splits", lines,
                  {"model": model_name, "verdict": verdict,
                   "splits": {f"{m}x{a_}": v for (m, a_), v in agg.items()},
                   "runs": {f"{m}x{a_}": [{k: v for k, v in r.items() if k != "rows"} for r in rs]
                            for (m, a_), rs in runs.items()}})


if __name__ == "__main__":
    main()
