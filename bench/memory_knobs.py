"""The optimizer states in 8 and 4 bits and activation offloading on a causal LM: states, peak, per-step loss.

The SFT job of ``bench/vs_trl.py`` (BBC articles -> headlines, completion-only loss, padding-free
micro-batches, the fused LM head) with every weight training (``--lora 0``, the default here: LoRA's
optimizer states are too small to show), each arm one training through onegpu itself
(:func:`onegpu.training.session.plan`, ``build_model`` and ``fit``: the accelerate backend), from the same
seeded weights on the same data in the same order:

- ``adamw``: ``train.optim: adamw_torch`` (fp32 states, 8 bytes per trained weight): the reference;
- ``8bit`` / ``4bit``: ``adamw_torch_8bit`` / ``adamw_torch_4bit`` (torchao's ``AdamW8bit`` / ``AdamW4bit``):
  another training (quantised states), their distance to ``adamw`` measured, not bounded;
- ``offload``: ``adamw`` with ``train.activation_offloading`` (TRL's context: the saved activations in pinned
  host memory). CUDA only: not run on a CPU (the config refuses it there).

Per arm: the optimizer states (the recorder's ``mem_optimizer_bytes``, taken after step 1: bytes) and their
ratio to ``adamw``'s; the device peak over the steps (the recorder's ``mem_peak_bytes``: CUDA peak allocated,
else the process's resident set: bytes) and its ratio; what one micro-batch saves for backward
(``mem_activation_bytes``: bytes, on the device unless offloaded); step 1 (torchao compiles its step then)
and the steady step time (steps 2..N: seconds); each step's loss and the largest relative distance to
``adamw``'s. Checks (each a line; exit 1 when one fails): every loss finite; ``8bit`` states at most
:data:`MAX_STATE_RATIO` ``["8bit"]`` of ``adamw``'s and ``4bit`` at most ``["4bit"]`` (issue 32's bar); ``offload``
the same per-step losses as ``adamw`` within :data:`OFFLOAD_RTOL` (bytes move, values do not) and a lower peak.

``--model DIR``: another causal LM directory in place of the packaged SmolLM2 (the GPU check's SmolLM2-shaped
random-init model, ``bench/gpu_models.py smollm2``). Results: ``bench/results/memory_knobs[-tag].{md,json}``.

Run: ``python -m bench.memory_knobs`` (CPU: adamw, 8bit, 4bit; torchao's first steps compile, tens of seconds).
"""
from __future__ import annotations

import math
import os
import time

ARMS = ("adamw", "offload", "8bit", "4bit")
# train.* overrides of each arm
SETTINGS = {"adamw": {"optim": "adamw_torch"}, "offload": {"optim": "adamw_torch", "activation_offloading": True},
            "8bit": {"optim": "adamw_torch_8bit"}, "4bit": {"optim": "adamw_torch_4bit"}}
# Largest optimizer states of the low-bit arms as a share of adamw's (issue 32: at most 0.35x / 0.2x).
MAX_STATE_RATIO = {"8bit": 0.35, "4bit": 0.2}
# Largest relative per-step loss difference of offload to adamw: bytes move, values do not; the slack is
# for nondeterministic CUDA kernels (attention's backward), far below what a misplaced tensor gives.
OFFLOAD_RTOL = 1e-3


def _cfg(args, arm: str):
    """``arm``'s config: :func:`bench.vs_trl.sft_cfg` under ``--bf16`` as ``train.bf16``, no OOM retry, the
    arm's :data:`SETTINGS`."""
    from bench.vs_trl import sft_cfg
    return sft_cfg(args, bf16=bool(args.bf16), oom_retry=False, **SETTINGS[arm])


def arms_here(cuda: bool, wanted: tuple[str, ...] = ARMS) -> list[str]:
    """The arms to run: ``wanted`` in :data:`ARMS`' order, ``offload`` only with CUDA; ``adamw`` always (the
    reference)."""
    return [a for a in ARMS if (a == "adamw" or a in wanted) and (cuda or a != "offload")]


def train_arm(args, arm: str, dsd, tok) -> dict:
    """One training of ``arm``: its per-step rows (loss, step time, peak) and memory breakdown."""
    from onegpu.training import session
    cfg = _cfg(args, arm)
    plan = session.plan(cfg, {"fingerprint": "bench"})
    model, _ = session.build_model(cfg, plan.model_path, plan.stats, tok)
    start = time.perf_counter()
    _, rec = session.fit(plan, model, tok, dsd, lambda metrics, step: None, checkpoints=False)
    rows = [{k: r[k] for k in ("step", "loss", "step_time_s", "mem_peak_bytes")} for r in rec.rows]
    return {"rows": rows, "memory": rec.memory(), "wall_s": time.perf_counter() - start, "device": plan.device}


def checks(runs: dict) -> list[tuple[bool, str]]:
    """``(passed, sentence)`` for each check of the module docstring that the arms run allow."""
    ref = runs["adamw"]
    states = {a: r["memory"].get("mem_optimizer_bytes") for a, r in runs.items()}
    out = [(all(math.isfinite(x["loss"]) for r in runs.values() for x in r["rows"]), "every loss is finite")]
    for arm, most in MAX_STATE_RATIO.items():
        if arm in runs:
            got = states[arm] / states["adamw"]
            out.append((got <= most, f"{arm}: optimizer states {got:.3f}x adamw's (at most {most}x)"))
    if "offload" in runs:
        d = distance(runs["offload"], ref)
        out.append((d <= OFFLOAD_RTOL, f"offload: per-step losses within {d:.1e} of adamw's "
                                       f"(at most {OFFLOAD_RTOL:g})"))
        a, b = peak(runs["offload"]), peak(ref)
        out.append((a < b, f"offload: peak {a / 2**20:.0f} MiB, adamw's {b / 2**20:.0f} MiB (lower)"))
    return out


def distance(run: dict, ref: dict) -> float:
    """Largest relative difference of ``run``'s per-step losses from ``ref``'s."""
    return max(abs(x["loss"] - y["loss"]) / abs(y["loss"]) for x, y in zip(run["rows"], ref["rows"]))


def peak(run: dict) -> int:
    return max(r["mem_peak_bytes"] for r in run["rows"])


def report_lines(args, runs: dict, model: str, load: list[float]) -> list[str]:
    """The Markdown: the setup, the per-arm table, the per-step losses and the checks."""
    from onegpu.formatting import markdown_table, mib, ratio
    ref = runs["adamw"]
    rows = []
    for arm, r in runs.items():
        t = [x["step_time_s"] for x in r["rows"][1:]]
        opt = r["memory"].get("mem_optimizer_bytes")
        rows.append([arm, SETTINGS[arm]["optim"] + (", offloading" if arm == "offload" else ""),
                     mib(opt, unit=False), ratio(opt / ref["memory"]["mem_optimizer_bytes"]),
                     mib(peak(r), unit=False), ratio(peak(r) / peak(ref)),
                     mib(r["memory"].get("mem_activation_bytes"), unit=False), f"{r['rows'][0]['step_time_s']:.2f}",
                     f"{sum(t) / len(t):.3f}" if t else "-", "" if arm == "adamw" else f"{distance(r, ref):.1e}"])
    steps = [[i + 1] + [f"{r['rows'][i]['loss']:.6f}" for r in runs.values()] for i in range(len(ref["rows"]))]
    where = "CUDA peak allocated" if ref["device"].startswith("cuda") else "the process's resident set (a CPU)"
    skipped = [] if "offload" in runs or ref["device"].startswith("cuda") else [
        "offload: not run (CUDA only; on a CPU the activations are in host memory already)."]
    return [f"{model}, {'LoRA r=' + str(args.lora) if args.lora else 'every weight'}, data.max_length "
            f"{args.max_length}, padding-free, fused LM head, {args.steps} steps of {args.micro} x {args.accum}, "
            f"lr {args.lr}, {'bf16 autocast' if args.bf16 else 'fp32'}; each arm one training from the same "
            "weights on the same data (onegpu's accelerate backend).", "",
            markdown_table(["arm", "train.optim", "optimizer states (MiB)", "vs adamw", "peak (MiB)", "vs adamw",
                            "saved for backward, one micro-batch (MiB)", "step 1 (s)", "steady step (s)",
                            "max rel. loss diff to adamw"], rows), "",
            markdown_table(["step"] + [f"loss {a}" for a in runs], steps), "",
            *skipped, f"Peak: {where}. Load average during the run: {min(load):.2f}-{max(load):.2f} (the "
            f"machine's cores: {os.cpu_count()}).", "",
            *[f"- {'passed' if ok else '**FAILED**'}: {text}" for ok, text in checks(runs)]]


def main() -> int:
    from bench import environment
    p = environment.parser(__doc__.splitlines()[0], reps=1, steps=4, max_length=512, rows=64, micro=4, accum=1)
    p.add_argument("--lora", type=int, default=0, help="LoRA rank (0: every weight trains)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--model", default="packaged:SmolLM2-135M-Instruct", help="a causal LM directory")
    p.add_argument("--arms", default=",".join(ARMS), help=f"a subset of {','.join(ARMS)} (adamw always runs)")
    args = p.parse_args()
    environment.setup()
    import torch

    from bench.reporting import report
    from bench.vs_trl import model_name
    dsd, tok, path = _data(args)
    runs, load = {}, [os.getloadavg()[0]]
    for arm in arms_here(torch.cuda.is_available(), tuple(args.arms.split(","))):
        runs[arm] = train_arm(args, arm, dsd, tok)
        load.append(os.getloadavg()[0])
        r = runs[arm]
        print(f"{arm}: losses {[round(x['loss'], 6) for x in r['rows']]}, optimizer states "
              f"{r['memory'].get('mem_optimizer_bytes', 0) / 2**20:.1f} MiB, peak {peak(r) / 2**20:.0f} MiB",
              flush=True)
        # after each arm: a run stopped by a time limit leaves the arms it finished
        report("memory_knobs", args, __doc__.splitlines()[0], report_lines(args, runs, model_name(args, path), load),
               {"runs": runs})
    return 0 if all(ok for ok, _ in checks(runs)) else 1


def _data(args):
    """The SFT job's prepared rows, its tokenizer and the model's path."""
    from onegpu.data import pipeline
    from onegpu.models import loader
    cfg = _cfg(args, "adamw")
    path = loader.resolve_model_path(cfg.model.name_or_path)
    dsd, tok, _, _ = pipeline.prepare(cfg, "prompt-completion", lambda texts: loader.load_tokenizer(path, "causal-lm"))
    return dsd, tok, path


if __name__ == "__main__":
    raise SystemExit(main())
