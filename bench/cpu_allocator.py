"""train.cpu_allocator on a CPU: the caching setting against glibc's defaults, one process per run.

The setting is process-wide and cannot be undone (glibc has no call back to its dynamic defaults), so
unlike the other scripts each run here is its own Python process (the train stage's situation: one
training per process), the arms rotating between repetitions. Arms: ``system`` (glibc's defaults, as
onegpu trained before the setting existed), ``caching`` (the default now) and, with ``--set``, the
caching allocator plus overrides (e.g. ``onegpu tradeoffs``' recommendation). Per run: samples/s over
optimizer steps 2..N, the minor page faults and system CPU time of the training (``getrusage``), and the
process's peak RSS. Defaults = the default job (packaged MiniLM-L6, 500 rows, max_length 64, 8 x 2, 32
optimizer steps).
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys

from bench import arms, environment, machine, reporting
from onegpu.formatting import markdown_table, mib, ratio as ratio_fmt

ARMS = ("system", "caching")


def child(args) -> None:
    """One training with ``train.cpu_allocator=<args.child>``; prints one JSON line."""
    environment.setup()
    from onegpu.measure import memory
    overrides = (f"train.cpu_allocator={'system' if args.child == 'system' else 'caching'}", *(args.overrides or ()))
    cfg = arms.make_cfg(args, micro=args.micro, accum=args.accum, overrides=overrides)
    dsd, labels, tok, path = arms.data(cfg)
    model = arms.pretrained_model(cfg, labels, path)
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    res = arms.train_once(model, tok, dsd, cfg, release=False)
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"samples_per_second": res["samples_per_second"], "median_step_s": res["median_step_s"],
                      "train_s": res["wall_s"], "minor_faults": r1.ru_minflt - r0.ru_minflt,
                      "system_cpu_s": r1.ru_stime - r0.ru_stime, "user_cpu_s": r1.ru_utime - r0.ru_utime,
                      "peak_rss_bytes": memory.rss_peak_bytes()}))


def one(args, arm: str, overrides: tuple[str, ...]) -> dict:
    """One run of ``arm`` in its own process, on a quiet machine (``machine.clean_run``)."""
    cmd = [sys.executable, "-m", "bench.cpu_allocator", "--child", "system" if arm == "system" else "caching",
           "--micro", str(args.micro), "--accum", str(args.accum), "--steps", str(args.steps),
           "--rows", str(args.rows), "--max-length", str(args.max_length), "--seed", str(args.seed),
           *[a for o in overrides for a in ("--set", o)]]

    def run() -> dict:
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=environment.REPO)
        return json.loads(out.stdout.strip().splitlines()[-1])
    return machine.clean_run(run, args, arm)


def _args():
    p = environment.parser(__doc__.splitlines()[0], reps=3, steps=32, rows=500, micro=8, accum=2)
    p.add_argument("--set", dest="overrides", action="append", default=None, metavar="KEY=VALUE",
                   help="adds an arm: the caching allocator with these overrides, as `dvc exp run -S` takes "
                        "them (repeatable)")
    p.add_argument("--child", choices=ARMS, help=argparse.SUPPRESS)
    return p.parse_args()


def measure(args) -> dict:
    """Every arm's runs, each in its own process, the order rotating: ``{arm: [results]}``."""
    settings = {a: () for a in ARMS}
    if args.overrides:
        settings["caching + " + " ".join(args.overrides)] = tuple(args.overrides)

    # one() waits for a quiet machine itself (clean_run around the child process)
    return arms.run_reps(args, lambda rep: arms.rotated(list(settings), rep),
                         lambda arm: one(args, arm, settings[arm]),
                         lambda res: f"{res['samples_per_second']:.2f} samples/s (steps 2..N), "
                                     f"{res['minor_faults']:,} page faults, {res['system_cpu_s']:.1f} s system "
                                     f"CPU, peak RSS {mib(res['peak_rss_bytes'])}", clean=False)


def report_lines(args, runs: dict) -> tuple[list[str], dict]:
    """The table and the ratios against ``system`` and ``caching``; also returns the numbers."""
    names = list(runs)
    med = {a: {k: reporting.median(r[k] for r in runs[a])
               for k in runs[a][0] if isinstance(runs[a][0][k], (int, float))} for a in names}
    rows = [[a, ", ".join(f"{r['samples_per_second']:.2f}" for r in runs[a]), f"{med[a]['samples_per_second']:.2f}",
             f"{med[a]['median_step_s']:.4f} s", f"{med[a]['minor_faults']:,.0f}", f"{med[a]['system_cpu_s']:.1f} s",
             f"{med[a]['user_cpu_s']:.1f} s", mib(med[a]['peak_rss_bytes'])] for a in names]
    ratio = med["caching"]["samples_per_second"] / med["system"]["samples_per_second"]
    pairs = [c["samples_per_second"] / s["samples_per_second"] for c, s in zip(runs["caching"], runs["system"])]
    more_rss = med["caching"]["peak_rss_bytes"] - med["system"]["peak_rss_bytes"]

    def sps(a):
        return med[a]["samples_per_second"]
    lines = [f"`bench/cpu_allocator.py`: MiniLM-L6 (pretrained), {args.rows} training rows, max_length "
             f"{args.max_length}, {args.micro} x {args.accum}, {args.steps} optimizer steps per run, one process "
             f"per run, {args.reps} repetitions (order rotating), step 1 excluded from samples/s.", "",
             markdown_table(["arm (train.cpu_allocator)", "samples/s per rep (steps 2..N)", "median",
                             "median step time", "minor page faults (training)", "system CPU", "user CPU",
                             "peak RSS (process)"], rows),
             "",
             f"- caching / system, samples/s: **{ratio_fmt(ratio)}** (pairs: {', '.join(f'{x:.2f}' for x in pairs)}); "
             f"page faults {med['system']['minor_faults'] / max(1, med['caching']['minor_faults']):.1f}x fewer; "
             f"peak RSS {'+' if more_rss >= 0 else ''}{mib(more_rss)} (freed memory stays in the process).",
             *[f"- {a} / system, samples/s: **{ratio_fmt(sps(a) / sps('system'))}**;"
               f" / caching: **{ratio_fmt(sps(a) / sps('caching'))}**." for a in names[2:]],
             "- " + machine.load_note([r for a in names for r in runs[a]])]
    return lines, {"runs": runs, "ratio": ratio, "pairs": pairs}


def main() -> None:
    args = _args()
    if args.child:
        child(args)
        return
    environment.setup()
    lines, payload = report_lines(args, measure(args))
    reporting.report("cpu_allocator", args, "train.cpu_allocator: caching against glibc's defaults", lines, payload)


if __name__ == "__main__":
    main()
