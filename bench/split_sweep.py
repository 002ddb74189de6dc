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

from bench import arms, environment, machine, reporting
from onegpu.formatting import markdown_table, mib, ratio


def parse_split(s: str) -> tuple[int, int]:
    m, a = s.lower().split("x")
    return int(m), int(a)


def _args():
    p = environment.parser(__doc__.splitlines()[0], reps=2, steps=3, rows=200)
    p.add_argument("--splits", default="64x1,16x4,4x16,1x64", help="micro x accumulation, comma-separated")
    p.add_argument("--layers", type=int, default=None,
                   help="use a BERT built from the MiniLM config with this many layers (random init) "
                        "instead of the pretrained MiniLM-L6")
    p.add_argument("--hidden", type=int, default=None, help="hidden size of that BERT (default 384)")
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing on for every split")
    return p.parse_args()


# -- the arms ----------------------------------------------------------------------------------------

def measure(args, splits: list[str]) -> tuple[str, dict]:
    """Every split ``MxA``, smallest micro-batch first (then the reverse, alternating between
    repetitions). Returns the model's name and ``{split: [run results]}``."""
    cfgs = {s: arms.make_cfg(args, micro=parse_split(s)[0], accum=parse_split(s)[1],
                               checkpointing=args.checkpointing) for s in splits}
    dsd, labels, tok, path = arms.data(cfgs[splits[0]])
    need = max(m * a for m, a in map(parse_split, splits)) * args.steps
    if len(dsd["train"]) < need:
        print(f"note: {len(dsd['train'])} training rows < {need} (effective batch x steps): the data wraps "
              "around and the epoch's last step may be partial")
    arms.warm_up(args)

    build, name = arms.builder(cfgs[splits[0]], labels, path, args.layers, args.hidden)
    order = sorted(splits, key=lambda s: (parse_split(s)[0], -parse_split(s)[1]))  # smallest micro-batch first
    runs = arms.run_reps(args, lambda rep: order if rep % 2 == 0 else order[::-1],
                           lambda s: arms.train_or_oom(lambda: build(cfgs[s]), tok, dsd, cfgs[s], args.verbose),
                           arms.training_line)
    return name, {s: runs[s] for s in splits}


def _tokens_per_second(rows: list[dict]) -> float:
    keep = [x for x in rows if x["step"] >= 2]
    return sum(x["tokens"] for x in keep) / sum(x["step_time_s"] for x in keep)


def summarize(runs: dict) -> dict:
    """Per split: medians over repetitions (samples/s, step time, tokens/s over steps 2..N, memory)."""
    agg = {s: arms.medians(rs) for s, rs in runs.items()}
    for a in agg.values():
        a["tokens_per_second"] = reporting.median(_tokens_per_second(r["rows"])
                                                  for r in a.pop("ok") if len(r["rows"]) > 1)
    return agg


# -- the report --------------------------------------------------------------------------------------

def _rows(agg: dict, best: str | None) -> list[list]:
    rows = []
    for s, a in agg.items():
        m, acc = parse_split(s)
        if a["oom"]:
            rows.append([f"{m} x {acc}", "OOM", "", "", "", "", ""])
            continue
        rows.append([f"{m} x {acc}", f"{a['samples_per_second']:.2f}",
                     f"{a['samples_per_second'] / agg[best]['samples_per_second']:.2f}", f"{a['median_step_s']:.3f} s",
                     f"{a['tokens_per_second']:,.0f}", mib(a["train_mem_peak_bytes"]), mib(a["mem_activation_bytes"])])
    return rows


def verdict(agg: dict) -> dict | None:
    """Does 4 x 16 beat 1 x 64: the samples/s and peak-memory ratios (None when either is missing)."""
    a, b = agg.get("4x16"), agg.get("1x64")
    if not a or not b or a["oom"] or b["oom"]:
        return None
    return {"4x16_over_1x64": a["samples_per_second"] / b["samples_per_second"],
            "4x16_peak_over_1x64": a["train_mem_peak_bytes"] / b["train_mem_peak_bytes"],
            "4x16_activations_over_1x64": a["mem_activation_bytes"] / b["mem_activation_bytes"]}


def report_lines(args, name: str, agg: dict, all_runs: list, cuda: bool) -> list[str]:
    best = max((s for s in agg if not agg[s]["oom"]), key=lambda s: agg[s]["samples_per_second"], default=None)
    effs = sorted({m * a for m, a in map(parse_split, agg)})
    lines = [
        f"`bench/split_sweep.py`: {name}, effective batch {'/'.join(map(str, effs))}, max_length "
        f"{args.max_length}, {'bf16 mixed precision' if args.bf16 else 'float32'}, checkpointing "
        f"{'on' if args.checkpointing else 'off'}, {args.steps} optimizer steps per split, {args.reps} "
        "repetition(s), step 1 excluded.",
        "",
        markdown_table(["micro-batch x accumulation", "samples/s", "vs best", "median step time",
                        "tokens/s (non-padding)", "peak memory (CUDA allocator)" if cuda else "peak RSS (process)",
                        "mem_activation_bytes (one micro-batch)"], _rows(agg, best)),
        "",
    ]
    v = verdict(agg)
    if v:
        f = v["4x16_over_1x64"]
        lines.append(f"- 4 x 16 {'beats' if f > 1 else 'does not beat'} 1 x 64: **{ratio(f)}** the samples/s, at "
                     f"{ratio(v['4x16_peak_over_1x64'])} the peak memory and {v['4x16_activations_over_1x64']:.1f}x "
                     "the activation bytes per micro-batch.")
    if best:
        lines.append(f"- Fastest split here: {' x '.join(map(str, parse_split(best)))}.")
    return lines + [f"- {machine.load_note(all_runs)}"]


def main() -> None:
    args = _args()
    environment.setup()
    import torch
    splits = [f"{m}x{a}" for m, a in (parse_split(s) for s in args.splits.split(",") if s.strip())]
    name, runs = measure(args, splits)
    agg = summarize(runs)
    reporting.report("split_sweep", args, "Split sweep: one effective batch, four splits",
                  report_lines(args, name, agg, [r for v in runs.values() for r in v], torch.cuda.is_available()),
                  {"model": name, "verdict": verdict(agg), "splits": agg, "runs": arms.without_rows(runs)})


if __name__ == "__main__":
    main()
