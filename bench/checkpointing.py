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
  (``onegpu.measure.activation_bytes``, the train-begin probe); reduction factor = none/arm;
- peak memory: ``train_mem_peak_bytes`` (max over steps: CUDA allocator peak on GPU, process RSS peak
  on CPU, which includes the model, optimizer states and whatever the allocator keeps).

The curve table lists the arms by activation memory with their step-time overhead, and marks the arms
on the trade-off frontier (no other arm is both faster and smaller): the points a user picks from.

Models: the packaged MiniLM-L6 (pretrained) and a deeper BERT built from the MiniLM config
(random init: speed and memory only; ``--deep-layers``/``--deep-hidden`` size it).
"""
from __future__ import annotations

import common

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


def main() -> None:
    p = common.parser(__doc__.splitlines()[0], reps=3, steps=6, rows=200, micro=8, accum=1)
    p.add_argument("--models", default="default,deep", help="comma-separated: default, deep")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, from: {', '.join(ARMS)}")
    p.add_argument("--deep-layers", type=int, default=12, help="layers of the deeper BERT")
    p.add_argument("--deep-hidden", type=int, default=None, help="hidden size of the deeper BERT (default 384)")
    args = p.parse_args()
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in arms if a not in ARMS]
    if unknown or "none" not in arms:
        p.error(f"--arms: {', '.join(unknown) or 'none is missing'}; give names from {', '.join(ARMS)}, "
                "including none (the baseline)")
    common.setup()
    import torch

    cfgs = {a: common.make_cfg(args, micro=args.micro, accum=args.accum, **ARMS[a][1]) for a in arms}
    dsd, labels, tok, path = common.data(cfgs["none"])
    common.warm_up(args)

    def build(which, cfg):
        if which == "default":
            return common.pretrained_model(cfg, labels, path)
        return common.bert_from_config(cfg, labels, path, args.deep_layers, args.deep_hidden)

    results: dict = {}
    all_runs = []
    for which in [m.strip() for m in args.models.split(",") if m.strip()]:
        probe = build(which, cfgs["none"])
        name = ("MiniLM-L6 (pretrained), " if which == "default" else "from config, random init, ") \
            + common.describe_model(probe)
        del probe
        runs: dict = {a: [] for a in arms}
        for rep in range(args.reps):
            order = arms[rep % len(arms):] + arms[:rep % len(arms)]  # each arm leads once every len(arms) reps
            for arm in order:
                cfg = cfgs[arm]

                def one(cfg=cfg):
                    try:
                        return common.train_once(build(which, cfg), tok, dsd, cfg, verbose=args.verbose)
                    except (torch.OutOfMemoryError, RuntimeError) as e:
                        if not common.is_oom(e):
                            raise
                        common.release_memory()
                        return {"oom": True}
                res = common.clean_run(one, args, f"{which} {arm}")
                runs[arm].append(res)
                if res.get("oom"):
                    print(f"{which} rep {rep + 1} checkpointing {ARMS[arm][0]}: out of memory")
                    continue
                print(f"{which} rep {rep + 1}/{args.reps} checkpointing {ARMS[arm][0]}: median step "
                      f"{res['median_step_s']:.4f} s, activations {common.mib(res['memory'].get('mem_activation_bytes'))}, "
                      f"peak {common.mib(res['summary'].get('train_mem_peak_bytes'))}", flush=True)
        agg = {}
        for arm in arms:
            all_runs += runs[arm]
            ok = [r for r in runs[arm] if not r.get("oom")]
            agg[arm] = {
                "oom": not ok,
                "median_step_s": common.median(r["median_step_s"] for r in ok),
                "samples_per_second": common.median(r["samples_per_second"] for r in ok),
                "mem_activation_bytes": common.median(r["memory"].get("mem_activation_bytes") for r in ok),
                "train_mem_peak_bytes": common.median(r["summary"].get("train_mem_peak_bytes") for r in ok),
                "per_rep_median_step_s": [r["median_step_s"] for r in ok],
            }
        base = agg["none"]
        for arm, a in agg.items():
            if a["oom"] or base["oom"]:
                a["overhead"] = a["activation_reduction"] = None
                continue
            a["overhead"] = a["median_step_s"] / base["median_step_s"] - 1
            a["activation_reduction"] = (base["mem_activation_bytes"] / a["mem_activation_bytes"]
                                         if a["mem_activation_bytes"] else None)
        ok = {arm: (a["median_step_s"], a["mem_activation_bytes"]) for arm, a in agg.items()
              if not a["oom"] and a["mem_activation_bytes"] is not None}
        results[which] = {"name": name, "arms": agg, "frontier": sorted(frontier(ok)),
                          "runs": {arm: [{k: v for k, v in r.items() if k != "rows"} for r in rs]
                                   for arm, rs in runs.items()}}

    peak_name = "peak (CUDA allocator)" if torch.cuda.is_available() else "peak RSS (process)"
    rows = []
    for which, r in results.items():
        # The curve: arms from most to least activation memory, each with what it costs in step time.
        order = sorted(r["arms"], key=lambda arm: (r["arms"][arm]["oom"], -(r["arms"][arm]["mem_activation_bytes"] or 0)))
        for arm in order:
            a = r["arms"][arm]
            if a["oom"]:
                rows.append([r["name"], ARMS[arm][0], "OOM", "", "", "", "", "", ""])
                continue
            rows.append([
                r["name"], ARMS[arm][0],
                ", ".join(f"{x:.3f}" for x in a["per_rep_median_step_s"]) + f" (median {a['median_step_s']:.3f} s)",
                "" if arm == "none" or a["overhead"] is None else f"{100 * a['overhead']:+.1f}%",
                f"{a['samples_per_second']:.1f}",
                common.mib(a["mem_activation_bytes"]),
                "" if arm == "none" or not a["activation_reduction"] else f"{a['activation_reduction']:.1f}x less",
                common.mib(a["train_mem_peak_bytes"]),
                "yes" if arm in r["frontier"] else "no",
            ])
    prec = "bf16 mixed precision" if args.bf16 else "float32"
    lines = [
        f"`bench/checkpointing.py`: {args.micro} x {args.accum} per optimizer step, max_length {args.max_length}, "
        f"{prec}, {args.steps} optimizer steps per run, {args.reps} repetitions (arm order rotating), "
        "step 1 excluded. Rows per model from most to least activation memory: the memory-against-step-time "
        "curve; \"on the frontier\": no other setting is both faster and smaller.",
        "",
        common.table(["model", "checkpointing", "median step time per rep (s)", "step-time overhead",
                      "samples/s", "mem_activation_bytes (one micro-batch)", "activation reduction",
                      peak_name, "on the frontier"], rows),
        "",
    ]
    for which, r in results.items():
        for arm, a in r["arms"].items():
            if arm == "none" or a["overhead"] is None or not a["activation_reduction"]:
                continue
            ov = 100 * a["overhead"]
            where = ""
            if arm == "layer":
                where = (" (below the guide's ~20% on GPU)" if ov < 15 else " (near the guide's ~20% on GPU)" if ov < 30
                         else " (about the ~33% that one recomputed forward pass costs)" if ov <= 37
                         else " (above the ~33% of one recomputed forward pass)")
            lines.append(f"- {r['name']}, {ARMS[arm][0]}: **{ov:+.1f}%** step time{where} for "
                         f"**{a['activation_reduction']:.1f}x** less activation memory "
                         f"({common.mib(r['arms']['none']['mem_activation_bytes'])} -> "
                         f"{common.mib(a['mem_activation_bytes'])} per micro-batch).")
    lines.append(f"- {common.load_note(all_runs)}")
    if not torch.cuda.is_available():
        lines.append("- On CPU the process RSS peak is dominated by the model, optimizer states and allocator "
                     "caches, so it moves far less than the activation bytes; the activation column is the "
                     "device-independent measure.")
    common.report("checkpointing", args, "Activation checkpointing: step time against activation memory", lines,
                  {"results": results})


if __name__ == "__main__":
    main()
