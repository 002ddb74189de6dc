"""The recommended same-training configuration against the default params, paired in one process.

`onegpu tradeoffs` on the default job picks the fastest configuration that keeps the same training
(its "Recommendation" line, `-S` overrides of params.yaml). Its own table times each experiment once;
this script measures the pick against the default params the way the other benchmarks do: both arms in
one process, from a freshly built model with the same seed, the order alternating between repetitions,
each run waiting for a quiet machine, and speed over optimizer steps 2..N. Each run is the train stage's
run (``arms.stage_run``) into the script's temporary MLflow store; at the end ``onegpu compare`` runs
on the first run of each arm, and on one more pair with dropout off (``model.dropout=0``, a few steps):
the speed-up counts only if the training is the same (exactly, or, with dropout on, up to the dropout
masks that another split or kernel draws).

Defaults = the default job (params.yaml as committed): packaged MiniLM-L6, 500 training rows, max_length
64, 8 x 2, one epoch (32 optimizer steps). ``--set`` takes the recommendation's overrides.
"""
from __future__ import annotations

from bench import arms, environment, machine, reporting
from onegpu.formatting import markdown_table, mib, ratio

TARGET = 1.2


# The recommendation of `onegpu tradeoffs` on the default job, this project's 2-core CPU machine
# (bench/README.md has the table it came from).
DEFAULT_RECOMMENDATION = ("train.per_device_train_batch_size=16", "train.gradient_accumulation_steps=1")




def _args():
    p = environment.parser(__doc__.splitlines()[0], reps=3, steps=32, rows=500, micro=8, accum=2)
    p.add_argument("--set", dest="overrides", action="append", default=None, metavar="KEY=VALUE",
                   help="an override of the recommended arm, as `dvc exp run -S` takes it (repeatable; "
                        "default: the recommendation measured on the default job, see bench/README.md)")
    p.add_argument("--exact-steps", type=int, default=6,
                   help="optimizer steps of the dropout-off pair that checks exact equivalence")
    args = p.parse_args()
    args.overrides = tuple(args.overrides or DEFAULT_RECOMMENDATION)
    return args


# -- the arms ----------------------------------------------------------------------------------------

def measure(args, tracker) -> tuple[dict, dict]:
    """The paired runs (default and recommended, the order alternating), then one more pair with
    dropout off (``args.exact_steps`` steps). Returns ``({arm: [results]}, {arm: run id of the exact pair})``."""
    cfgs = {"default": arms.make_cfg(args, micro=args.micro, accum=args.accum),
            "recommended": arms.make_cfg(args, micro=args.micro, accum=args.accum, overrides=args.overrides)}
    dsd, labels, tok, path = arms.data(cfgs["default"])
    arms.warm_up(args)

    runs = arms.run_reps(args, lambda rep: arms.rotated(list(cfgs), rep), lambda arm: arms.stage_run(
        tracker, arms.pretrained_model(cfgs[arm], labels, path), tok, dsd, cfgs[arm], args.verbose),
        lambda res: f"{res['samples_per_second']:.2f} samples/s (steps 2..N), median step "
                    f"{res['median_step_s']:.4f} s, first step {res['step_times_s'][0]:.2f} s, "
                    f"train {res['total_s']:.1f} s")
    exact = {}
    for arm in cfgs:  # the same pair with dropout off, a few steps: the same mathematics exactly?
        cfg = arms.make_cfg(args, micro=args.micro, accum=args.accum, steps=args.exact_steps,
                              overrides=(*(args.overrides if arm == "recommended" else ()), "model.dropout=0"))
        exact[arm] = arms.stage_run(tracker, arms.pretrained_model(cfg, labels, path), tok, dsd, cfg,
                                      args.verbose)["run_id"]
    return runs, exact


def verdicts(ids: list[str], out: str) -> tuple[int, list[str]]:
    """``onegpu compare`` on these runs: the number of equivalence keys and each non-reference verdict."""
    from onegpu.stages import compare
    comparison = compare.run("bench-recommended", run_ids=ids, out_dir=environment.tmpdir() / out)
    return len(comparison.groups), [c.verdict for g in comparison.groups for c in g.rows if not c.is_reference]


# -- the report --------------------------------------------------------------------------------------

def report_lines(args, runs: dict, sps: dict, found: dict) -> list[str]:
    """The table per arm and the findings; ``found``: the compare verdicts and whether the target is met."""
    step = {a: reporting.median(r["median_step_s"] for r in runs[a]) for a in runs}
    total = {a: reporting.median(r["total_s"] for r in runs[a]) for a in runs}
    rows = [[a, f"`{' '.join('-S ' + o for o in args.overrides)}`" if a == "recommended" else "params.yaml defaults",
             ", ".join(f"{r['samples_per_second']:.2f}" for r in runs[a]), f"{sps[a]:.2f}", f"{step[a]:.4f} s",
             f"{runs[a][0]['step_times_s'][0]:.2f} s", f"{total[a]:.1f} s",
             mib(runs[a][0]["summary"].get("train_mem_peak_bytes"))] for a in ("default", "recommended")]
    keys, exact_keys = found["keys"], found["exact_keys"]
    return [
        f"`bench/recommended.py`: MiniLM-L6 (pretrained), {args.rows} training rows, max_length {args.max_length}, "
        f"{args.micro} x {args.accum} by default, {args.steps} optimizer steps per run, {args.reps} paired "
        "repetitions (order alternating), step 1 excluded from samples/s.", "",
        markdown_table(["arm", "params", "samples/s per rep (steps 2..N)", "median", "median step time",
                        "step 1", "train time (median)", "peak RSS (process)"], rows), "",
        f"- Recommended / default, samples/s: **{ratio(found['ratio'])}** (pairs: "
        f"{', '.join(f'{x:.2f}' for x in found['pairs'])}).",
        f"- `onegpu compare` (first run of each arm): {'one equivalence key' if keys == 1 else f'{keys} keys'}, "
        f"verdict **{', '.join(found['verdicts']) or 'none'}**; the same pair with `model.dropout=0` "
        f"({args.exact_steps} steps): {'one key' if exact_keys == 1 else f'{exact_keys} keys'}, verdict "
        f"**{', '.join(found['exact_verdicts']) or 'none'}** (with dropout on, another split or kernel draws other "
        "masks: the runs agree in expectation only).",
        f"- Target >= {TARGET:.1f}x with the same training: **{'met' if found['met'] else 'NOT met'}**.",
        f"- {machine.load_note(runs['default'] + runs['recommended'])}",
    ]


def main() -> None:
    args = _args()
    environment.setup()
    from onegpu import tracking
    tracker = tracking.connect("bench-recommended")  # <tmp>/mlflow.db, deleted at exit
    runs, exact = measure(args, tracker)
    print("\nonegpu compare on the first run of each arm:")
    keys, verdict = verdicts([runs["default"][0]["run_id"], runs["recommended"][0]["run_id"]], "compare")
    print(f"\nonegpu compare with model.dropout=0 ({args.exact_steps} steps):")
    exact_keys, exact_verdict = verdicts([exact["default"], exact["recommended"]], "compare-exact")
    same = keys == 1 and (verdict == ["equivalent"] or exact_keys == 1 and exact_verdict == ["equivalent"])
    sps = {a: reporting.median(r["samples_per_second"] for r in runs[a]) for a in runs}
    ratio = sps["recommended"] / sps["default"]
    pairs = [r["samples_per_second"] / d["samples_per_second"] for r, d in zip(runs["recommended"], runs["default"])]
    found = {"keys": keys, "verdicts": verdict, "exact_keys": exact_keys, "exact_verdicts": exact_verdict,
             "ratio": ratio, "pairs": pairs, "met": ratio >= TARGET and same}
    reporting.report("recommended", args, "The recommended same-training configuration against the defaults",
                  report_lines(args, runs, sps, found),
                  {"overrides": list(args.overrides), "runs": runs, "ratio": ratio, "pairs": pairs,
                   "verdicts": verdict, "exact_verdicts": exact_verdict, "same_training": same})


if __name__ == "__main__":
    main()
