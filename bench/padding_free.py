"""Padding-free batches against padded ones on the SFT example: tokens/s and memory, paired in one process.

The model of ``make sft`` (docs/sft.md): the packaged SmolLM2-135M-Instruct, LoRA r=8, completion-only loss,
on BBC headlines as prepare tokenizes them. ``--prompt lead`` (the default): the prompt is the instruction and
the article's lead paragraph only (written as a prompt-completion JSON Lines file in a temporary folder, the
topic as label), whose natural, uneven lengths leave real padding in a padded micro-batch; ``--prompt
article``: ``make sft``'s own data (the whole article, cut to ``data.max_length``, so every row is about as
long as the cap and there is almost no padding). Arms ``padded`` and ``padding_free`` take the same optimizer
steps (same examples per micro-batch and step, accelerate backend) and alternate ABAB... for ``--reps``
rotations in one process. Per arm: non-padding tokens/s over optimizer steps 2..N (median of the rotations),
the activations saved for one micro-batch (``mem_activation_bytes``: where padding costs memory), the
process's peak RSS during the arm, and the first step's loss (the two arms' must agree: same training).
Printed first: the share of padding the padded micro-batches held (micro-batches of the seeded order). Results
go to ``bench/results/padding_free.{md,json}``; the machine's load average is printed with them.

Run: ``python -m bench.padding_free`` (``--prompt article`` for ``make sft``'s data).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from onegpu.formatting import markdown_table, mib, ratio

RESULTS = Path(__file__).resolve().parent / "results"


def _cfg(args, padding_free: bool):
    from onegpu.config import from_container
    return from_container({
        "data": {"source": args.source, "max_length": args.max_length, "max_train_samples": args.rows,
                 "max_eval_samples": 16, "padding_free": padding_free},
        "model": {"task": "causal-lm", "name_or_path": "packaged:SmolLM2-135M-Instruct", "dropout": 0.0,
                  "lora": {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": None}},
        "train": {"backend": "accelerate", "per_device_train_batch_size": args.micro,
                  "gradient_accumulation_steps": args.accum, "max_steps": args.steps, "learning_rate": 3e-4,
                  "logging_steps": 10**6, "seed": 42}}, source="bench")


def write_leads(folder: Path) -> Path:
    """The packaged headlines with each prompt cut to the instruction and the article's first paragraph,
    as ``folder/leads.jsonl`` (prompt, completion, label = topic)."""
    from onegpu.data import prompt_completion as pc
    data = pc.headlines()
    out = folder / "leads.jsonl"
    with out.open("w") as f:
        for row, label in zip(data.records(), data.labels):
            lead = row["prompt"].removeprefix(pc.HEADLINE_INSTRUCTION).split("\n\n")[0]
            f.write(json.dumps({"prompt": pc.HEADLINE_INSTRUCTION + lead if lead else "",
                                "completion": row["completion"], "label": label}) + "\n")
    return out


def _data(args):
    """The SFT example's rows as prepare tokenizes them, and its tokenizer."""
    from onegpu.data import pipeline
    from onegpu.models import loader
    cfg = _cfg(args, False)
    path = loader.resolve_model_path(cfg.model.name_or_path)
    dsd, tok, stats, _ = pipeline.prepare(cfg, "prompt-completion",
                                          lambda texts: loader.load_tokenizer(path, "causal-lm"))
    return dsd, tok, path, stats


def padding_share(lengths: list[int], micro: int, seed: int) -> float:
    """Share of padding tokens in micro-batches of ``micro`` rows of a seeded shuffle, each padded to its longest."""
    import random
    order = list(range(len(lengths)))
    random.Random(seed).shuffle(order)
    real = padded = 0
    for i in range(0, len(order), micro):
        chunk = [lengths[j] for j in order[i:i + micro]]
        real += sum(chunk)
        padded += max(chunk) * len(chunk)
    return 1 - real / padded


def arm(args, dsd, tok, path, padding_free: bool) -> dict:
    """One training of ``--steps`` optimizer steps; its steady tokens/s, activation bytes and peak RSS."""
    from onegpu.models import loader, lora
    from onegpu.training.backends import accelerate
    from onegpu.training.backends.base import TrainRequest
    cfg = _cfg(args, padding_free)
    import transformers
    transformers.set_seed(cfg.train.seed)
    model = loader.build_causal_lm(path, tok, cfg.model, cfg.data.max_length, 0.0)
    model = lora.apply(model, cfg.model.lora_adapters, "causal-lm")
    start = time.perf_counter()
    _, steps = accelerate.train(TrainRequest(model, tok, dsd, cfg, sink=lambda m, s: None))
    rows = steps.rows
    steady = rows[1:] or rows
    return {"tokens_per_second": sum(r["tokens"] for r in steady) / sum(r["step_time_s"] for r in steady),
            "samples_per_second": sum(r["samples"] for r in steady) / sum(r["step_time_s"] for r in steady),
            "mem_activation_bytes": steps.breakdown.get("mem_activation_bytes"),
            "peak_rss_bytes": max(r["mem_peak_bytes"] for r in rows), "first_loss": rows[0]["loss"],
            "losses": [r["loss"] for r in rows], "wall_s": time.perf_counter() - start}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=2, help="rotations of the two arms (default 2)")
    p.add_argument("--steps", type=int, default=4, help="optimizer steps per arm (default 4)")
    p.add_argument("--rows", type=int, default=64, help="training rows (default 64)")
    p.add_argument("--micro", type=int, default=8, help="micro-batch (default 8, as make sft)")
    p.add_argument("--accum", type=int, default=1, help="accumulation (default 1)")
    p.add_argument("--max-length", type=int, default=160,
                   help="data.max_length (default 160: no lead paragraph is cut; make sft: 96)")
    p.add_argument("--prompt", choices=("lead", "article"), default="lead",
                   help="the article's lead paragraph (default: uneven lengths) or the whole article (make sft)")
    p.add_argument("--out", default=None, help="results path without suffix (default: results/padding_free, "
                                                "results/padding_free-article with --prompt article)")
    args = p.parse_args()
    args.out = args.out or str(RESULTS / ("padding_free" if args.prompt == "lead" else "padding_free-article"))
    from onegpu.models import loader
    loader.go_offline()
    from datasets.utils.logging import disable_progress_bar
    disable_progress_bar()
    with tempfile.TemporaryDirectory(prefix="onegpu-bench-") as tmp:
        args.source = str(write_leads(Path(tmp))) if args.prompt == "lead" else "bbcnews-headlines"
        dsd, tok, path, stats = _data(args)
        args.source = args.prompt  # the results name the data, not the temporary file
    share = padding_share(dsd["train"]["length"], args.micro, 42)
    print(f"data: {len(dsd['train'])} training rows, max_length {args.max_length}, lengths p50 "
          f"{stats['splits']['train']['length_p50']:.0f} / p90 {stats['splits']['train']['length_p90']:.0f}; "
          f"padding in micro-batches of {args.micro}: {share:.1%} of the padded tokens")
    runs = {"padded": [], "padding_free": []}
    load = [os.getloadavg()[0]]
    for rep in range(args.reps):
        for name in ("padded", "padding_free"):
            runs[name].append(arm(args, dsd, tok, path, name == "padding_free"))
            load.append(os.getloadavg()[0])
            r = runs[name][-1]
            print(f"rotation {rep + 1}/{args.reps} {name}: {r['tokens_per_second']:.0f} tokens/s, activations "
                  f"{mib(r['mem_activation_bytes'])}, peak RSS {mib(r['peak_rss_bytes'])}, "
                  f"step-1 loss {r['first_loss']:.6f}", flush=True)
    _report(args, runs, share, stats, load)


def _report(args, runs: dict, share: float, stats: dict, load: list[float]) -> None:
    from bench import machine
    m = machine.describe()
    med = {k: statistics.median(r["tokens_per_second"] for r in v) for k, v in runs.items()}
    act = {k: v[0]["mem_activation_bytes"] for k, v in runs.items()}
    rss = {k: max(r["peak_rss_bytes"] for r in v) for k, v in runs.items()}
    same = max(abs(a - b) / abs(b) for ra, rb in zip(runs["padding_free"], runs["padded"])
               for a, b in zip(ra["losses"], rb["losses"]))
    lines = [f"# Padding-free against padded: SmolLM2-135M-Instruct, LoRA r=8, headlines ({len(runs['padded'])} "
             f"rotations, {args.steps} steps of {args.micro} x {args.accum}, max_length {args.max_length}, prompt "
             f"{'the lead paragraph' if args.prompt == 'lead' else 'the whole article'})", "",
             machine.line(m), "",
             f"Padding in the padded micro-batches: {share:.1%} of their tokens. Largest relative difference of the "
             f"per-step losses between the arms: {same:.1e}. Load average during the runs: "
             f"{min(load):.1f}-{max(load):.1f} on {os.cpu_count()} cores.", ""]
    head = ["arm", "tokens/s (median)", "vs padded", "activations, one micro-batch (MiB)", "peak RSS (MiB)"]
    lines.append(markdown_table(head, [[k, f"{med[k]:.0f}", ratio(med[k] / med["padded"]), mib(act[k], unit=False),
                                        mib(rss[k], unit=False)] for k in ("padded", "padding_free")]))
    text = "\n".join(lines)
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(text + "\n")
    out.with_suffix(".json").write_text(json.dumps({"args": vars(args), "machine": m, "padding_share": share,
                                                    "runs": runs, "load_average": load, "max_rel_loss_diff": same},
                                                   indent=1))


if __name__ == "__main__":
    main()
