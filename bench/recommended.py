"""The recommended same-training configuration against the default params, paired in one process.

`onegpu tradeoffs` on the default job picks the fastest configuration that keeps the same training
(its "Recommendation" line, `-S` overrides of params.yaml). Its own table times each experiment once;
this script measures the pick against the default params the way the other benchmarks do: both arms in
one process, from a freshly built model with the same seed, the order alternating between repetitions,
each run waiting for a quiet machine, and speed over optimizer steps 2..N. Each run is the train stage's
run (``common.stage_run``) into the script's temporary MLflow store; at the end ``onegpu compare`` runs
on the first run of each arm, and on one more pair with dropout off (``model.dropout=0``, a few steps):
the speed-up counts only if the training is the same (exactly, or, with dropout on, up to the dropout
masks that another split or kernel draws).

Defaults = the default job (params.yaml as committed): packaged MiniLM-L6, 500 training rows, max_length
64, 8 x 2, one epoch (32 optimizer steps). ``--set`` takes the recommendation's overrides.
"""
from __future__ import annotations

import common

TARGET = 1.2


def main() -> None:
    p = common.parser(__doc__.splitlines()[0], reps=3, steps=32, rows=500, micro=8, accum=2)
    p.add_argument("--set", dest="overrides", action="append", default=None, metavar="KEY=VALUE",
                   help="an override of the recommended arm, as `dvc exp run -S` takes it (repeatable; "
                        "default: the recommendation measured on the default job, see bench/README.md)")
    p.add_argument("--exact-steps", type=int, default=6,
                   help="optimizer steps of the dropout-off pair that checks exact equivalence")
    args = p.parse_args()
    overrides = tuple(args.overrides or DEFAULT_RECOMMENDATION)
    common.setup()
    from onegpu import tracking
    from onegpu.stages import compare

    tracker = tracking.connect("bench-recommended")  # <tmp>/mlflow.db, deleted at exit
    cfgs = {"default": common.make_cfg(args, micro=args.micro, accum=args.accum),
            "recommended": common.make_cfg(args, micro=args.micro, accum=args.accum, overrides=overrides)}
    dsd, labels, tok, path = common.data(cfgs["default"])
    common.warm_up(args)

    runs = {a: [] for a in cfgs}
    for rep in range(args.reps):
        for arm in (("default", "recommended") if rep % 2 == 0 else ("recommended", "default")):
            def one(arm=arm):
                cfg = cfgs[arm]
                return common.stage_run(tracker, common.pretrained_model(cfg, labels, path), tok, dsd, cfg,
                                        args.verbose)
            res = common.clean_run(one, args, arm)
            res["rep"] = rep
            runs[arm].append(res)
            print(f"rep {rep + 1}/{args.reps} {arm:11s}: {res['samples_per_second']:.2f} samples/s (steps 2..N), "
                  f"median step {res['median_step_s']:.4f} s, first step {res['step_times_s'][0]:.2f} s, "
                  f"train {res['total_s']:.1f} s", flush=True)

    def verdicts_of(ids: list[str], out: str):
        comparison = compare.run("bench-recommended", run_ids=ids, out_dir=common.tmpdir() / out)
        return len(comparison.groups), [c.verdict for g in comparison.groups for c in g.rows if not c.is_reference]

    print("\nonegpu compare on the first run of each arm:")
    keys, verdicts = verdicts_of([runs["default"][0]["run_id"], runs["recommended"][0]["run_id"]], "compare")
    # The same pair with dropout off, a few steps: is the recommendation the same mathematics exactly?
    exact = {}
    for arm in ("default", "recommended"):
        cfg = common.make_cfg(args, micro=args.micro, accum=args.accum, steps=args.exact_steps,
                              overrides=(*(overrides if arm == "recommended" else ()), "model.dropout=0"))
        exact[arm] = common.stage_run(tracker, common.pretrained_model(cfg, labels, path), tok, dsd, cfg,
                                      args.verbose)["run_id"]
    print(f"\nonegpu compare with model.dropout=0 ({args.exact_steps} steps):")
    exact_keys, exact_verdicts = verdicts_of([exact["default"], exact["recommended"]], "compare-exact")
    same = keys == 1 and (verdicts == ["equivalent"] or exact_keys == 1 and exact_verdicts == ["equivalent"])

    sps = {a: common.median(r["samples_per_second"] for r in runs[a]) for a in runs}
    step = {a: common.median(r["median_step_s"] for r in runs[a]) for a in runs}
    total = {a: common.median(r["total_s"] for r in runs[a]) for a in runs}
    ratio = sps["recommended"] / sps["default"]
    pairs = [r["samples_per_second"] / d["samples_per_second"] for r, d in zip(runs["recommended"], runs["default"])]
    met = ratio >= TARGET and same
    rows = [[a, f"`{' '.join('-S ' + o for o in overrides)}`" if a == "recommended" else "params.yaml defaults",
             ", ".join(f"{r['samples_per_second']:.2f}" for r in runs[a]), f"{sps[a]:.2f}", f"{step[a]:.4f} s",
             f"{runs[a][0]['step_times_s'][0]:.2f} s", f"{total[a]:.1f} s",
             common.mib(runs[a][0]["summary"].get("train_mem_peak_bytes"))]
            for a in ("default", "recommended")]
    lines = [
        f"`bench/recommended.py`: MiniLM-L6 (pretrained), {args.rows} training rows, max_length {args.max_length}, "
        f"{args.micro} x {args.accum} by default, {args.steps} optimizer steps per run, {args.reps} paired "
        "repetitions (order alternating), step 1 excluded from samples/s.",
        "",
        common.table(["arm", "params", "samples/s per rep (steps 2..N)", "median", "median step time",
                      "step 1", "train time (median)", "peak RSS (process)"], rows),
        "",
        f"- Recommended / default, samples/s: **{ratio:.2f}x** (pairs: {', '.join(f'{x:.2f}' for x in pairs)}).",
        f"- `onegpu compare` (first run of each arm): {'one equivalence key' if keys == 1 else f'{keys} keys'}, "
        f"verdict **{', '.join(verdicts) or 'none'}**; the same pair with `model.dropout=0` "
        f"({args.exact_steps} steps): {'one key' if exact_keys == 1 else f'{exact_keys} keys'}, verdict "
        f"**{', '.join(exact_verdicts) or 'none'}** (with dropout on, another split or kernel draws other masks: "
        "the runs agree in expectation only).",
        f"- Target >= {TARGET:.1f}x with the same training: **{'met' if met else 'NOT met'}**.",
        f"- {common.load_note(runs['default'] + runs['recommended'])}",
    ]
    common.report("recommended", args, "The recommended same-training configuration against the defaults",
                  lines, {"overrides": list(overrides), "runs": runs, "ratio": ratio, "pairs": pairs,
                          "verdicts": verdicts, "exact_verdicts": exact_verdicts, "same_training": same})


# The recommendation of `onegpu tradeoffs` on the default job, this project's 2-core CPU machine
# (bench/README.md has the table it came from).
DEFAULT_RECOMMENDATION = ("train.per_device_train_batch_size=16", "train.gradient_accumulation_steps=1")


if __name__ == "__main__":
    main()
