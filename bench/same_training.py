"""Equivalent splits of the packaged chat model, on a job where rounding cannot hide a difference.

The job (issue 40's): the packaged SmolLM2-135M-Instruct, full fine-tuning, prompt-completion rows whose
answers are one word ("yes"/"no") after prompts of 3-30 words, completion-only loss, ``data.max_length`` 64,
``model.dropout`` 0, AdamW, 3 optimizer steps of an effective batch of 8. Its targets are few and
confident, so a loss path whose rounding depends on the micro-batch (the fused LM head through TRL's
float32 kernel: 7e-5..1.5e-4 at step 1) shows at once. Arms: the whole logits at 8 x 1 (the reference),
the whole logits at 1 x 8 (their own floor), then the fused LM head at 8 x 1, 4 x 2, 2 x 4, 1 x 8 and 2 x 4
padding-free on both backends. Printed per
arm: the relative difference to the reference of step 1's loss and grad_norm (before any update can
amplify one) and the largest over the steps; then what ``onegpu compare`` says of the runs (its own
code, on records built from the arms' steps). ``--dtype float64`` casts model and inputs to float64.

Run: ``python -m bench.same_training`` (about 4 min here; ``--dtype float64`` about 10).
"""
from __future__ import annotations

import time

from onegpu.formatting import markdown_table

NAME = "same_training"
WORDS = ("is the bank about to cut rates as markets rose while the team won the final and a new film opened "
         "to fine reviews after the minister spoke about growth jobs and trade in the north").split()
# (label, micro-batch, accumulation, padding-free, backend, fused head); the reference first (whole logits),
# then the whole logits' own worst split (their floor), then the fused head's splits on both backends.
ARMS = [("whole 8x1", 8, 1, False, "trainer", False), ("whole 1x8", 1, 8, False, "trainer", False)] + [
    (f"fused {backend} {m}x{a}{' pf' if pf else ''}", m, a, pf, backend, True)
    for backend in ("trainer", "accelerate") for m, a, pf in ((8, 1, False), (4, 2, False), (2, 4, False),
                                                             (1, 8, False), (2, 4, True))]


def yes_no_rows(n: int) -> dict:
    """``n`` prompt-completion rows: prompts of 3..30 words ending in "?", answers "yes" or "no"."""
    prompts = ["Answer yes or no: " + " ".join((WORDS * 3)[i:i + 3 + (11 * i) % 28]) + "?" for i in range(n)]
    return {"prompt": prompts, "completion": ["yes" if i % 2 else "no" for i in range(n)]}


def data(tokenizer, n: int, max_length: int = 64):
    """The rows tokenized as prepare does (:func:`onegpu.data.tokenize_instructions`)."""
    from datasets import ClassLabel, Dataset, DatasetDict

    from onegpu.config import DataConfig
    from onegpu.data import tokenize_instructions
    ds = Dataset.from_dict({**yes_no_rows(n), "label": ["text"] * n}).cast_column("label", ClassLabel(names=["text"]))
    out, dropped, _ = tokenize_instructions(DatasetDict(train=ds), tokenizer, DataConfig(max_length=max_length),
                                            "prompt-completion")
    assert dropped == 0
    return out


def arm(label, micro, accum, padding_free, backend, fused, tok, dsd, args) -> dict:
    """One training of ``args.steps`` optimizer steps; its step rows."""
    import importlib

    import torch

    from onegpu.config import PACKAGED_CHAT_MODEL, from_container
    from onegpu.models import loader
    from onegpu.training.backends import base
    from onegpu.training.objectives import lm_head
    cfg = from_container({"data": {"max_length": 64, "padding_free": padding_free},
                          "model": {"task": "causal-lm", "name_or_path": PACKAGED_CHAT_MODEL, "dropout": 0.0},
                          "train": {"backend": backend, "per_device_train_batch_size": micro,
                                    "gradient_accumulation_steps": accum, "max_steps": args.steps,
                                    "learning_rate": 1e-4, "seed": 42, "logging_steps": 10**6}}, source="bench")
    model = loader.build_causal_lm(loader.resolve_model_path(PACKAGED_CHAT_MODEL), tok, None, 64, 0.0)
    model = model.to(getattr(torch, args.dtype))
    if fused:
        lm_head.attach(model)
    start = time.perf_counter()
    _, steps = importlib.import_module(base.REGISTRY[backend]).train(
        base.TrainRequest(model, tok, dsd, cfg, sink=lambda m, s: None))
    print(f"{label}: {time.perf_counter() - start:.0f} s", flush=True)
    return {"label": label, "micro": micro, "accum": accum, "padding_free": padding_free, "backend": backend,
            "fused": fused, "rows": [{k: r[k] for k in ("step", "loss", "grad_norm", "targets")} for r in steps.rows]}


def _rel(x: float, y: float) -> float:
    return abs(x - y) / abs(y)


def record(run: dict, start: int):
    """A :class:`onegpu.compare.RunRecord` of one arm, as the training stage would have logged it."""
    from onegpu.compare import RunRecord
    params = {"resolved.per_device_train_batch_size": str(run["micro"]),
              "resolved.gradient_accumulation_steps": str(run["accum"]), "resolved.effective_batch_size": "8",
              "train.gradient_checkpointing": "False", "train.bf16": "False", "train.fp16": "False",
              "train.backend": run["backend"], "train.fused_lm_head": str(run["fused"]),
              "data.padding_free": str(run["padding_free"])}
    return RunRecord(run_id=run["label"], name=run["label"], params=params,
                     tags={"equivalence_key": "same-job", "device": "cpu", "stage": "train"},
                     series={k: [(r["step"], r[k]) for r in run["rows"]] for k in ("loss", "grad_norm")},
                     start_time=start, status="FINISHED")


def report_lines(runs: list[dict]) -> list[str]:
    from onegpu import compare
    ref = runs[0]["rows"]
    table = [[r["label"], f"{_rel(r['rows'][0]['loss'], ref[0]['loss']):.1e}",
              f"{_rel(r['rows'][0]['grad_norm'], ref[0]['grad_norm']):.1e}",
              f"{max(_rel(a['loss'], b['loss']) for a, b in zip(r['rows'], ref)):.1e}",
              f"{max(_rel(a['grad_norm'], b['grad_norm']) for a, b in zip(r['rows'], ref)):.1e}"]
             for r in runs[1:]]
    assert all([a["targets"] for a in r["rows"]] == [b["targets"] for b in ref] for r in runs)
    group = compare.compare([record(r, i) for i, r in enumerate(runs)]).groups[0]  # the whole logits: first
    verdicts = [[c.run.run_id, c.verdict, "; ".join(n for n in c.notes if not n.startswith("no eval metrics"))]
                for c in group.rows]
    return ["Relative difference to the whole logits at 8 x 1 (the same targets in every step):", "",
            markdown_table(["arm", "step-1 loss", "step-1 grad_norm", "loss, any step",
                            "grad_norm, any step"], table), "",
            "What `onegpu compare` says of these runs (records built from their steps):", "", group.summary, "",
            markdown_table(["run", "verdict", "notes"], verdicts)]


def main() -> None:
    from bench import environment, reporting
    p = environment.parser(__doc__.splitlines()[0], reps=1, steps=3)
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    args = p.parse_args()
    environment.setup()
    from onegpu.config import PACKAGED_CHAT_MODEL
    from onegpu.models import loader
    tok = loader.load_tokenizer(loader.resolve_model_path(PACKAGED_CHAT_MODEL), "causal-lm")
    dsd = data(tok, 8 * args.steps)
    runs = [arm(*a, tok=tok, dsd=dsd, args=args) for a in ARMS]
    title = f"Equivalent splits of SmolLM2-135M-Instruct on one-word answers ({args.dtype}, {args.steps} steps of 8)"
    reporting.report(NAME, args, title, report_lines(runs), {"runs": runs})


if __name__ == "__main__":
    main()
