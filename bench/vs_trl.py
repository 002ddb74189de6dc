"""onegpu's LM head against TRL's on the same SFT micro-batches: losses, bytes saved for backward, peak, time.

The job of ``make sft`` (docs/sft.md): the packaged SmolLM2-135M-Instruct with LoRA r=8 (``--lora 0``: every
weight), BBC articles -> headlines as prepare tokenizes them (prompt = instruction + article, cut to
``--max-length``; a short headline answers), completion-only loss, padding-free micro-batches. Three arms
train the same optimizer steps from the same weights on the same collated micro-batches (one list, built
once; each arm checks the SHA-256 of every micro-batch's ``input_ids`` it trains on against that list):

- ``whole``: onegpu with ``train.fused_lm_head: false`` (the whole ``(rows, tokens, vocab)`` logits);
- ``fused``: onegpu's default (:mod:`onegpu.training.objectives.lm_head`: the targets' logits only, in tiles);
- ``trl``: the model patched by TRL's ``add_fused_lm_head`` as ``SFTTrainer.__init__`` does (outputs
  ``log_probs``, ``entropy``, ``is_top1``) and called as ``SFTTrainer.compute_loss`` calls it
  (``fused_lm_head=True``, ``labels``, ``num_items_in_batch``: the step's target count).

Each optimizer step: forward and backward per micro-batch, the loss divided by the step's targets, gradient
clipping at 1.0, AdamW (torch, lr ``--lr``). Printed: per-step loss and grad_norm of each arm and their
largest relative difference to ``fused``; bytes saved for backward by one micro-batch (the largest of the
first step's; :func:`onegpu.measure.memory.saved_bytes`: unique storages, parameters left out); peak memory
per arm (CUDA: peak allocated; CPU: the resident set's high-water mark above the arm's start, with every
block of 64 KiB or more mapped and unmapped by glibc so the resident set follows the live tensors); steady
step time (steps 2..N) per repetition, arms alternating, min-max over ``--reps``. Results go to
``bench/results/vs_trl[-tag].{md,json}`` with the machine and its load.

``--model DIR``: another causal LM directory in place of the packaged SmolLM2 (the GPU check's SmolLM2-shaped
random-init model, ``bench/gpu_models.py smollm2``: the packaged GGUF does not travel). ``--bf16``: each
micro-batch's forward and loss under bf16 autocast (as ``train.bf16`` trains; fp32 weights and optimizer).

Run: ``python -m bench.vs_trl --max-length 128`` and ``python -m bench.vs_trl --max-length 2048 --tag 2048``.
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import time
from pathlib import Path

ARMS = ("whole", "fused", "trl")
PACKAGED = "packaged:SmolLM2-135M-Instruct"


def sft_cfg(args, **train):
    """The SFT job's ``Config`` from the options (``--max-length``, ``--rows``, ``--model``, ``--lora``,
    ``--micro``, ``--accum``, ``--steps``, ``--lr``), with ``train`` (``train.*`` values) on top; also
    :mod:`bench.memory_knobs`' arms."""
    from onegpu.config import from_container
    return from_container({
        "data": {"source": "bbcnews-headlines", "max_length": args.max_length, "max_train_samples": args.rows,
                 "max_eval_samples": 16, "padding_free": True},
        "model": {"task": "causal-lm", "name_or_path": args.model, "dropout": 0.0,
                  "lora": {"r": args.lora, "alpha": 2.0 * args.lora, "dropout": 0.0, "target_modules": None}
                  if args.lora else None},
        "train": {"backend": "accelerate", "per_device_train_batch_size": args.micro,
                  "gradient_accumulation_steps": args.accum, "max_steps": args.steps, "learning_rate": args.lr,
                  "logging_steps": 10**6, "seed": 42, **train}}, source="bench")


def micro_batches(args, cfg):
    """``(steps, tokenizer, path)``: ``--steps`` lists of ``--accum`` collated padding-free micro-batches
    of ``--micro`` rows (the prepared rows in a seeded order), and the model's tokenizer and path."""
    import random

    from onegpu.data import pipeline
    from onegpu.models import loader
    from onegpu.training.objectives import model_inputs
    from onegpu.training.objectives.batches import PaddingFreeCollator
    path = loader.resolve_model_path(cfg.model.name_or_path)
    dsd, tok, _, _ = pipeline.prepare(cfg, "prompt-completion", lambda texts: loader.load_tokenizer(path, "causal-lm"))
    rows = model_inputs(dsd, "causal-lm")["train"]
    order = list(range(len(rows)))
    random.Random(42).shuffle(order)
    need = args.steps * args.accum * args.micro
    order = (order * (need // len(order) + 1))[:need]
    collate = PaddingFreeCollator()
    mbs = [collate([rows[i] for i in order[j:j + args.micro]]) for j in range(0, need, args.micro)]
    return [mbs[s * args.accum:(s + 1) * args.accum] for s in range(args.steps)], tok, path


def digest(mb: dict) -> str:
    return hashlib.sha256(mb["input_ids"].numpy().tobytes()).hexdigest()[:16]


def model_name(args, path) -> str:
    """The model in words: the packaged SmolLM2, or ``--model``'s folder with its architecture and size
    (and "random init" where ``RANDOM_INIT.txt`` says so: bench/gpu_models.py)."""
    if args.model == PACKAGED:
        return "SmolLM2-135M-Instruct"
    import json
    c = json.loads((Path(path) / "config.json").read_text())
    init = ", random init" if (Path(path) / "RANDOM_INIT.txt").is_file() else ""
    return (f"{Path(path).name} ({(c.get('architectures') or [c.get('model_type')])[0]}, {c['num_hidden_layers']} "
            f"layers, hidden {c['hidden_size']}, vocabulary {c['vocab_size']}{init})")


def autocast(device: str, bf16: bool):
    """bf16 autocast on ``device`` (as ``train.bf16``), or nothing."""
    if not bf16:
        return contextlib.nullcontext()
    import torch
    return torch.autocast("cuda" if device.startswith("cuda") else "cpu", dtype=torch.bfloat16)


def build(arm: str, cfg, tok, path, device: str):
    """The arm's model: the same weights and adapters for every arm (seeded), patched as the arm needs."""
    import transformers

    from onegpu.models import loader, lora
    from onegpu.training.objectives import lm_head
    transformers.set_seed(cfg.train.seed)
    model = loader.build_causal_lm(path, tok, cfg.model, cfg.data.max_length, 0.0)
    if cfg.model.lora_adapters is not None:
        model = lora.apply(model, cfg.model.lora_adapters, "causal-lm")
    loader.no_kv_cache(model)
    if arm == "fused":
        lm_head.check(model, Path(path).name)
        lm_head.attach(model)
    elif arm == "trl":
        from trl.trainer.utils import add_fused_lm_head
        add_fused_lm_head(model.get_base_model() if hasattr(model, "get_base_model") else model,
                          outputs=("log_probs", "entropy", "is_top1"))
    return model.to(device).train()


def loss_of(arm: str, model, mb: dict, num_items, bf16: bool = False):
    """One micro-batch's share of the step's mean loss, as the arm computes it (``bf16``: under bf16 autocast)."""
    from onegpu.training.objectives.loss import causal_lm_loss
    features = {k: v for k, v in mb.items() if k != "labels"}
    with autocast(str(mb["input_ids"].device), bf16):
        if arm == "trl":
            return model(**features, labels=mb["labels"], num_items_in_batch=num_items, fused_lm_head=True).loss
        return causal_lm_loss(model(**features), mb["labels"], num_items)


class _TrlCall:
    """``saved_bytes``' view of the TRL arm: a model whose forward returns TRL's loss (labels from the batch)."""

    def __init__(self, model, labels, bf16: bool = False):
        self.model, self.labels, self.bf16 = model, labels, bf16
        self.parameters, self.train, self.eval = model.parameters, model.train, model.eval

    @property
    def training(self):
        return self.model.training

    def __call__(self, **features):
        return loss_of("trl", self.model, {**features, "labels": self.labels}, None, self.bf16)


def saved_bytes(arm: str, model, mb: dict, bf16: bool = False) -> int:
    """Bytes one micro-batch saves for backward (activations: under bf16 autocast, its weight copies apart)."""
    from onegpu.measure import memory
    from onegpu.training.objectives.loss import causal_lm_loss
    if arm == "trl":
        return memory.saved_bytes(_TrlCall(model, mb["labels"], bf16), mb, lambda out, labels: out)["activations"]
    with autocast(str(mb["input_ids"].device), bf16):
        return memory.saved_bytes(model, mb, causal_lm_loss)["activations"]


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


def _peak_reset(device: str) -> int:
    import torch
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    return _status("VmRSS")


def _peak(device: str, base: int) -> int:
    import torch
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    return _status("VmHWM") - base


def train_arm(arm: str, steps, cfg, tok, path, device: str, digests: list[str], bf16: bool = False) -> dict:
    """``--steps`` optimizer steps of ``arm``; its per-step loss, grad_norm and wall time, its peak."""
    import torch

    from onegpu.training.objectives import count_items
    model = build(arm, cfg, tok, path, device)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.train.learning_rate)
    saved = max(saved_bytes(arm, model, {k: v.to(device) for k, v in mb.items()}, bf16) for mb in steps[0])
    seen, rows = [], []
    base = _peak_reset(device)
    for step in steps:
        start = time.perf_counter()
        num_items = sum(count_items(mb["labels"], "causal-lm") for mb in step).to(device)
        loss = torch.zeros((), device=device)
        for mb in step:
            seen.append(digest(mb))
            part = loss_of(arm, model, {k: v.to(device) for k, v in mb.items()}, num_items, bf16)
            part.backward()
            loss += part.detach()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        rows.append({"loss": float(loss), "grad_norm": float(norm), "targets": int(num_items),
                     "step_time_s": time.perf_counter() - start})
    if seen != digests:
        raise AssertionError(f"{arm} trained on other micro-batches than the list")
    return {"rows": rows, "saved_bytes": saved, "peak_bytes": _peak(device, base), "device": device}


def report_lines(args, runs: dict, digests: list[str], load: list[float],
                 model: str = "SmolLM2-135M-Instruct") -> list[str]:
    """The Markdown: the micro-batches, the per-step table against ``fused``, the memory and time table
    (``model``: the model in words, :func:`model_name`)."""
    from onegpu.formatting import markdown_table, mib, ratio
    first = {arm: rs[0]["rows"] for arm, rs in runs.items()}
    peak_text = ("the CUDA allocator's peak allocated above the arm's start" if runs["fused"][0].get("device", "")
                 .startswith("cuda") else "the resident set's high-water mark above the arm's start")
    step_rows = [[i + 1, first["fused"][i]["targets"]]
                 + [f"{first[a][i]['loss']:.7f}" for a in ARMS] + [f"{first[a][i]['grad_norm']:.6f}" for a in ARMS]
                 for i in range(args.steps)]

    def rel(a: str, key: str) -> float:
        return max(abs(x[key] - y[key]) / abs(y[key]) for x, y in zip(first[a], first["fused"]))

    def steady(r: dict) -> float:
        t = [x["step_time_s"] for x in r["rows"][1:]] or [r["rows"][0]["step_time_s"]]
        return sum(t) / len(t)
    mem_rows = []
    for a in ARMS:
        times = [steady(r) for r in runs[a]]
        mem_rows.append([a, mib(runs[a][0]["saved_bytes"], unit=False),
                         ratio(runs[a][0]["saved_bytes"] / runs["trl"][0]["saved_bytes"]),
                         mib(max(r["peak_bytes"] for r in runs[a]), unit=False), f"{min(times):.2f}-{max(times):.2f}",
                         "" if a == "fused" else f"{rel(a, 'loss'):.1e} / {rel(a, 'grad_norm'):.1e}"])
    return [f"{model}, {'LoRA r=' + str(args.lora) if args.lora else 'every weight'}, "
            f"data.max_length {args.max_length}, padding-free, {args.steps} steps of {args.micro} x {args.accum}, "
            f"lr {args.lr}, {'bf16 autocast' if args.bf16 else 'fp32'}; the same {len(digests)} micro-batches in "
            f"every arm (SHA-256 of input_ids, first {digests[0]}, last {digests[-1]}); {args.reps} repetitions, "
            "arms alternating.", "",
            markdown_table(["step", "targets"] + [f"loss {a}" for a in ARMS] + [f"grad_norm {a}" for a in ARMS],
                           step_rows), "",
            markdown_table(["arm", "saved for backward, one micro-batch (MiB)", "vs trl", "peak (MiB)",
                            "steady step (s), min-max", "max rel. diff to fused: loss / grad_norm"], mem_rows), "",
            f"Peak: {peak_text}. Load average during the run: {min(load):.2f}-{max(load):.2f} (the machine's "
            f"cores: {os.cpu_count()})."]


def run_line(r: dict) -> str:
    """One arm's run for the progress line: its per-step losses, bytes saved for backward and peak."""
    return (f"losses {[round(x['loss'], 6) for x in r['rows']]}, saved {r['saved_bytes'] / 2**20:.1f} MiB, "
            f"peak {r['peak_bytes'] / 2**20:.0f} MiB")


def bench_args(doc: str, lr: float):
    """The command line of the side-by-side scripts (this one and bench/vs_trl_dpo.py) parsed, ``lr`` the
    default learning rate; then glibc's mmap threshold and :func:`bench.environment.setup` for the process."""
    from bench import environment
    p = environment.parser(doc.splitlines()[0], reps=3, steps=3, max_length=128, rows=64, micro=4, accum=2)
    p.add_argument("--lora", type=int, default=8, help="LoRA rank (0: every weight trains)")
    p.add_argument("--lr", type=float, default=lr)
    p.add_argument("--model", default=PACKAGED, help="a causal LM directory in place of the packaged SmolLM2")
    args = p.parse_args()
    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD: the resident set follows live tensors
    environment.setup()
    return args


def alternate(args, names: list[str], train_one) -> tuple[dict, list[float]]:
    """Each of ``names`` trained ``args.reps`` times by ``train_one(name) -> result``, the order rotated each
    repetition (:func:`bench.arms.rotated`), a progress line per run (:func:`run_line`); returns ``({name:
    [result per repetition]}, the 1-minute load average before the first run and after each)``."""
    from bench.arms import rotated, run_reps
    load = [os.getloadavg()[0]]

    def one(name: str) -> dict:
        result = train_one(name)
        load.append(os.getloadavg()[0])
        return result
    return run_reps(args, lambda rep: rotated(list(names), rep), one, run_line, clean=False), load


def the_steps(args, cfg, batches=micro_batches, digest_of=digest) -> tuple[str, list, object, str, list[str]]:
    """``(device, micro-batches per step, tokenizer, model path, each micro-batch's digest)`` for ``cfg`` by
    ``batches(args, cfg)`` and ``digest_of(micro-batch)`` (this script's, or bench/vs_trl_dpo.py's); the
    device is CUDA where there is one."""
    import torch
    steps, tok, path = batches(args, cfg)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return device, steps, tok, path, [digest_of(mb) for step in steps for mb in step]


def main() -> None:
    from bench.reporting import report
    args = bench_args(__doc__, lr=1e-3)
    cfg = sft_cfg(args)
    device, steps, tok, path, digests = the_steps(args, cfg)
    runs, load = alternate(args, list(ARMS), lambda arm: train_arm(arm, steps, cfg, tok, path, device, digests,
                                                                   args.bf16))
    report("vs_trl", args, "onegpu's LM head and TRL's on the same SFT micro-batches",
           report_lines(args, runs, digests, load, model_name(args, path)), {"digests": digests, "runs": runs})


if __name__ == "__main__":
    main()
