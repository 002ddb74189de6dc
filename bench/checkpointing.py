"""Activation checkpointing: step time against activation memory over the granularity settings.

For each model, paired runs in one process (the arms' order rotates between repetitions) of
``onegpu.training.session.fit``, same init, data and config, metrics sink a no-op, one run per arm:

- ``none``: ``train.gradient_checkpointing`` false;
- ``layer``: every transformer layer recomputes (HF's ``activation_checkpointing``, non-reentrant);
- ``every2``: layers 0, 2, 4, ... (``gradient_checkpointing_kwargs.every_n_layers: 2``);
- ``attention`` / ``mlp``: only that sub-block of every layer (``gradient_checkpointing_blocks``).

Per arm:

- step time: median over optimizer steps 2..N of each run, then the median over repetitions;
  overhead = arm/none - 1. The guide quotes about 20% on GPU for whole layers; recomputing the forward
  pass once bounds it near 33% (forward ~1/3 of forward + backward);
- ``mem_activation_bytes``: bytes autograd saves for backward in one forward pass of a micro-batch
  (``onegpu.measure.memory.activation_bytes``, the train-begin probe); reduction factor = none/arm;
- peak memory: ``train_mem_peak_bytes`` (max over steps: CUDA allocator peak on GPU, process RSS peak
  on CPU, which includes the model, optimizer states and whatever the allocator keeps).

The curve table lists the arms by activation memory with their step-time overhead, and marks the arms
on the trade-off frontier (no other arm is both faster and smaller): the points a user picks from.

Models: the packaged MiniLM-L6 (pretrained) and a deeper BERT built from the MiniLM config
(random init: speed and memory only; ``--deep-layers``/``--deep-hidden`` size it).
"""
from __future__ import annotations

from bench import arms, environment, machine, reporting
from onegpu.formatting import markdown_table, mib

# name -> (what the table calls it, train.* keys)
ARMS = {
    "none": ("none", {"gradient_checkpointing": False}),
    "layer": ("every layer", {"gradient_checkpointing": True}),
    "every2": ("every 2nd layer", {"gradient_checkpointing": True,
                                   "gradient_checkpointing_kwargs": {"use_reentrant": False, "every_n_layers": 2}}),
    "attention": ("attention only", {"gradient_checkpointing": True, "gradient_checkpointing_blocks": "attention"}),
    "mlp": ("MLP only", {"gradient_checkpointing": True, "gradient_checkpointing_blocks": "mlp"}),
}


def frontier(points: dict[str, tuple[float, float]]) -> set[str]:
    """Names whose (step time, activation bytes) no other point beats in both (ties: neither beats)."""
    return {a for a, (t, m) in points.items()
            if not any(t2 <= t and m2 <= m and (t2, m2) != (t, m) for b, (t2, m2) in points.items() if b != a)}


def _args():
    p = environment.parser(__doc__.splitlines()[0], reps=3, steps=6, rows=200, micro=8, accum=1)
    p.add_argument("--models", default="default,deep", help="comma-separated: default, deep")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, from: {', '.join(ARMS)}")
    p.add_argument("--deep-layers", type=int, default=12, help="layers of the deeper BERT")
    p.add_argument("--deep-hidden", type=int, default=None, help="hidden size of the deeper BERT (default 384)")
    args = p.parse_args()
    args.arm_names = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in args.arm_names if a not in ARMS]
    if unknown or "none" not in args.arm_names:
        p.error(f"--arms: {', '.join(unknown) or 'none is missing'}; give names from {', '.join(ARMS)}, "
                "including none (the baseline)")
    return args


# -- the arms ----------------------------------------------------------------------------------------

def measure_model(args, which: str, cfgs: dict, data: tuple) -> tuple[str, dict]:
    """Every arm on one model (``default``: MiniLM-L6, ``deep``: a BERT from its config), the arms'
    order rotating. Returns the model's name and ``{arm: [run results]}``."""
    dsd, labels, tok, path = data
    build, name = arms.builder(cfgs["none"], labels, path, None if which == "default" else args.deep_layers,
                                 args.deep_hidden)
    print(f"{name}:")
    runs = arms.run_reps(
        args, lambda rep: arms.rotated(args.arm_names, rep),
        lambda arm: arms.train_or_oom(lambda: build(cfgs[arm]), tok, dsd, cfgs[arm], args.verbose),
        arms.training_line)
    return name, runs


def summarize(runs: dict) -> dict:
    """Per arm: medians over repetitions, the step-time overhead and activation reduction against
    ``none`` (None when either ran out of memory)."""
    agg = {arm: arms.medians(rs) for arm, rs in runs.items()}
    for a in agg.values():
        a["per_rep_median_step_s"] = [r["median_step_s"] for r in a.pop("ok")]
    base = agg["none"]
    for a in agg.values():
        a["overhead"] = a["activation_reduction"] = None
        if not (a["oom"] or base["oom"]):
            a["overhead"] = a["median_step_s"] / base["median_step_s"] - 1
            a["activation_reduction"] = (base["mem_activation_bytes"] / a["mem_activation_bytes"]
                                         if a["mem_activation_bytes"] else None)
    return agg


# -- the report --------------------------------------------------------------------------------------

def _curve_rows(r: dict) -> list[list]:
    """One model's rows: the arms from most to least activation memory, each with its step-time cost."""
    rows = []
    for arm in sorted(r["arms"], key=lambda a: (r["arms"][a]["oom"], -(r["arms"][a]["mem_activation_bytes"] or 0))):
        a = r["arms"][arm]
        if a["oom"]:
            rows.append([r["name"], ARMS[arm][0], "OOM", "", "", "", "", "", ""])
            continue
        per_rep = ", ".join(f"{x:.3f}" for x in a["per_rep_median_step_s"])
        reduction = "" if arm == "none" or not a["activation_reduction"] else f"{a['activation_reduction']:.1f}x less"
        rows.append([r["name"], ARMS[arm][0], per_rep + f" (median {a['median_step_s']:.3f} s)",
                     "" if arm == "none" or a["overhead"] is None else f"{100 * a['overhead']:+.1f}%",
                     f"{a['samples_per_second']:.1f}", mib(a["mem_activation_bytes"]), reduction,
                     mib(a["train_mem_peak_bytes"]), "yes" if arm in r["frontier"] else "no"])
    return rows


def _overhead_line(r: dict, arm: str) -> str:
    a = r["arms"][arm]
    ov = 100 * a["overhead"]
    where = ""
    if arm == "layer":
        where = (" (below the guide's ~20% on GPU)" if ov < 15 else " (near the guide's ~20% on GPU)" if ov < 30
                 else " (about the ~33% that one recomputed forward pass costs)" if ov <= 37
                 else " (above the ~33% of one recomputed forward pass)")
    return (f"- {r['name']}, {ARMS[arm][0]}: **{ov:+.1f}%** step time{where} for "
            f"**{a['activation_reduction']:.1f}x** less activation memory "
            f"({mib(r['arms']['none']['mem_activation_bytes'])} -> {mib(a['mem_activation_bytes'])} per micro-batch).")


def report_lines(args, results: dict, all_runs: list, cuda: bool) -> list[str]:
    """The Markdown: the curve table per model, one line per arm's trade, the load note."""
    rows = [row for r in results.values() for row in _curve_rows(r)]
    lines = [
        f"`bench/checkpointing.py`: {args.micro} x {args.accum} per optimizer step, max_length {args.max_length}, "
        f"{'bf16 mixed precision' if args.bf16 else 'float32'}, {args.steps} optimizer steps per run, {args.reps} "
        "repetitions (arm order rotating), step 1 excluded. Rows per model from most to least activation "
        "memory: the memory-against-step-time curve; \"on the frontier\": no other setting is both faster and "
        "smaller.",
        "",
        markdown_table(["model", "checkpointing", "median step time per rep (s)", "step-time overhead",
                        "samples/s", "mem_activation_bytes (one micro-batch)", "activation reduction",
                        "peak (CUDA allocator)" if cuda else "peak RSS (process)", "on the frontier"], rows),
        "",
    ]
    lines += [_overhead_line(r, arm) for r in results.values() for arm, a in r["arms"].items()
              if arm != "none" and a["overhead"] is not None and a["activation_reduction"]]
    lines.append(f"- {machine.load_note(all_runs)}")
    if not cuda:
        lines.append("- On CPU the process RSS peak is dominated by the model, optimizer states and allocator "
                     "caches, so it moves far less than the activation bytes; the activation column is the "
                     "device-independent measure.")
    return lines


def main() -> None:
    args = _args()
    environment.setup()
    import torch
    cfgs = {a: arms.make_cfg(args, micro=args.micro, accum=args.accum, **ARMS[a][1]) for a in args.arm_names}
    data = arms.data(cfgs["none"])
    arms.warm_up(args)
    results, all_runs = {}, []
    for which in [m.strip() for m in args.models.split(",") if m.strip()]:
        name, runs = measure_model(args, which, cfgs, data)
        agg = summarize(runs)
        ok = {arm: (a["median_step_s"], a["mem_activation_bytes"]) for arm, a in agg.items()
              if not a["oom"] and a["mem_activation_bytes"] is not None}
        results[which] = {"name": name, "arms": agg, "frontier": sorted(frontier(ok)), "runs": arms.without_rows(runs)}
        all_runs += [r for rs in runs.values() for r in rs]
    reporting.report("checkpointing", args, "Activation checkpointing: step time against activation memory",
                  report_lines(args, results, all_runs, torch.cuda.is_available()), {"results": results})


if __name__ == "__main__":
    main()
