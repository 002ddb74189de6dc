"""onegpu's DPO against TRL's ``DPOTrainer`` on the same preference micro-batches: losses, rewards, memory, time.

The job of ``make dpo`` (docs/dpo.md): the packaged SmolLM2-135M-Instruct with LoRA r=8 (``--lora 0``: every
weight, the reference then a frozen copy in both arms), the packaged headline pairs as prepare tokenizes them
(``--max-length``), fp32, dropout off, beta 0.1, sigmoid loss. Two arms train the same optimizer steps from the
same weights on the same pairs (one list of micro-batches of ``--micro`` pairs, built once; each arm checks the
SHA-256 of every micro-batch's pairs it trains on against that list), every micro-batch holding as many pairs
(where TRL's per-micro-batch mean and onegpu's step mean agree):

- ``onegpu``: the preference objective's ``step_loss`` (:mod:`onegpu.training.objectives.preference`: the
  fused LM head, chosen and rejected alternating in one padded batch, the reference beside it);
- ``trl``: a ``DPOTrainer`` built on the same model (it patches the model with TRL's fused LM head), its
  ``compute_loss`` on TRL's collated batch (``DataCollatorForPreference``: all chosen, then all rejected),
  divided by the accumulation count as ``Trainer.training_step`` divides it.

Each optimizer step: forward and backward per micro-batch, gradient clipping at 1.0, AdamW (torch, ``--lr``).
Printed: per-step loss, grad_norm and ``rewards/*`` (chosen, rejected, accuracies, margins) of each arm and their
largest differences; bytes saved for backward by one micro-batch (:func:`onegpu.measure.memory.saved_bytes`), peak
memory (as :mod:`bench.vs_trl`: CUDA allocated, else the resident set), steady step time (steps 2..N) per
repetition, arms rotating, min-max over ``--reps``. Results: ``bench/results/vs_trl_dpo[-tag].{md,json}`` with the
machine and its load.

``--bf16``: each arm trains the same steps a second time (``onegpu-bf16``, ``trl-bf16``) with its micro-batches'
forward and loss under bf16 autocast (as ``train.bf16`` trains: fp32 weights, gradients and AdamW), reported per
step as its difference from the same arm in fp32 (bf16 minus fp32: loss, grad_norm, ``rewards/*``), never as
equal to it. ``--model DIR``: another causal LM directory in place of the packaged SmolLM2 (the GPU check's
SmolLM2-shaped random-init model, ``bench/gpu_models.py smollm2``: the packaged GGUF does not travel). The device
is CUDA where torch sees one, else the CPU.

Run: ``python -m bench.vs_trl_dpo``.
"""
from __future__ import annotations

import copy
import hashlib
import json
import os
import tempfile
import time

ARMS = ("onegpu", "trl")
PACKAGED = "packaged:SmolLM2-135M-Instruct"
FIGURES = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")
KEYS = ("loss", "grad_norm", *FIGURES)
BF16 = "-bf16"  # the suffix of an arm's run under bf16 autocast: "onegpu-bf16", "trl-bf16"


def run_names(bf16: bool) -> list[str]:
    """The runs of one repetition: each arm in fp32, then (``bf16``) each again under bf16 autocast."""
    return [*ARMS, *(a + BF16 for a in ARMS)] if bf16 else list(ARMS)


def dpo_cfg(args):
    """The DPO job's ``Config`` from the options (``--max-length``, ``--rows``, ``--model``, ``--lora``,
    ``--micro``, ``--accum``, ``--steps``, ``--lr``)."""
    from onegpu.config import from_container
    return from_container({
        "data": {"source": "bbcnews-headline-pairs", "max_length": args.max_length, "max_train_samples": args.rows,
                 "max_eval_samples": 16},
        "model": {"task": "preference", "name_or_path": getattr(args, "model", PACKAGED),
                  "lora": {"r": args.lora, "alpha": 2.0 * args.lora, "dropout": 0.0, "target_modules": None}
                  if args.lora else None},
        "train": {"backend": "accelerate", "per_device_train_batch_size": args.micro,
                  "gradient_accumulation_steps": args.accum, "max_steps": args.steps, "learning_rate": args.lr,
                  "logging_steps": 10**6, "seed": 42}}, source="bench")


def micro_batches(args, cfg):
    """``(steps, tokenizer, path)``: ``--steps`` lists of ``--accum`` micro-batches, each a list of ``--micro``
    pairs (``prompt_ids``, ``chosen_ids``, ``rejected_ids``) in a seeded order; the model's tokenizer and path."""
    import random

    from onegpu.data import pipeline
    from onegpu.models import loader
    from onegpu.training import objectives
    path = loader.resolve_model_path(cfg.model.name_or_path)
    dsd, tok, _, _ = pipeline.prepare(cfg, "preference", lambda texts: loader.load_tokenizer(path, "preference"))
    rows = objectives.get("preference").model_inputs(dsd)["train"]
    order = list(range(len(rows)))
    random.Random(42).shuffle(order)
    need = args.steps * args.accum * args.micro
    order = (order * (need // len(order) + 1))[:need]
    mbs = [[rows[i] for i in order[j:j + args.micro]] for j in range(0, need, args.micro)]
    return [mbs[s * args.accum:(s + 1) * args.accum] for s in range(args.steps)], tok, path


def digest(pairs: list[dict]) -> str:
    """SHA-256 (16 hex digits) of a micro-batch's pairs' token ids."""
    ids = [[p["prompt_ids"], p["chosen_ids"], p["rejected_ids"]] for p in pairs]
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]


class Arm:
    """One arm's model and how it computes a micro-batch's share of the step's loss and the step's figures.

    ``model``: the policy as built (every arm gets the same weights and adapters); ``cfg``: the job; ``bf16``: the
    micro-batches' forward and loss under bf16 autocast (fp32 weights and optimizer, as ``train.bf16``)."""

    def __init__(self, name: str, model, cfg, tok, device: str, bf16: bool = False):
        from onegpu.training import objectives
        from onegpu.training.objectives import lm_head
        self.name, self.cfg, self.pad, self.trainer = name, cfg, tok.pad_token_id, None
        self.device, self.bf16 = device, bf16
        self.objective = objectives.get("preference")
        if name == "onegpu":
            lm_head.attach(model)
            self.objective.prepare_model(model, cfg)
            self.model = model.to(device).train()
            self.take = self.objective.step_figures(self.model)
            return
        from datasets import Dataset
        from trl import DPOConfig, DPOTrainer
        pair = {"prompt": [{"role": "user", "content": "Write a headline."}],
                "chosen": [{"role": "assistant", "content": "Rates cut"}],
                "rejected": [{"role": "assistant", "content": "Team wins"}]}
        self._out = tempfile.TemporaryDirectory(prefix="onegpu-vs-trl-dpo-")
        targs = DPOConfig(output_dir=self._out.name, beta=cfg.train.dpo.beta, report_to=[], use_cpu=device == "cpu",
                          bf16=bf16,
                          per_device_train_batch_size=cfg.train.per_device_train_batch_size, disable_dropout=True,
                          max_length=None, logging_steps=1, save_strategy="no")
        # Without LoRA, TRL 1.16 would load its reference from the model's hub id or folder; the policy's copy
        # is the same weights (and works for a model built from config).
        ref = None if hasattr(model, "peft_config") else copy.deepcopy(model).to(device).eval()
        self.trainer = DPOTrainer(model=model.to(device), ref_model=ref, args=targs,
                                  train_dataset=Dataset.from_list([pair] * 2), processing_class=tok)
        self.model = self.trainer.model.train()

    def batch(self, pairs: list[dict], device: str) -> dict:
        """The arm's collated micro-batch on ``device``."""
        if self.name == "onegpu":
            from onegpu.training.objectives.dpo import PreferenceCollator
            b = PreferenceCollator(self.pad)(pairs)
        else:
            from trl.trainer.dpo_trainer import DataCollatorForPreference
            b = DataCollatorForPreference(pad_token_id=self.pad)([{k: list(v) for k, v in p.items()} for p in pairs])
        return {k: v.to(device) for k, v in b.items()}

    def loss(self, batch: dict, pairs_in_step: int):
        """The micro-batch's share of the step's loss, as the arm's trainer computes it (under bf16 autocast for a
        ``bf16`` arm)."""
        from bench.vs_trl import autocast
        with autocast(self.device, self.bf16):
            if self.name == "onegpu":
                return self.objective.step_loss(self.model, batch, pairs_in_step)
            return self.trainer.compute_loss(self.model, batch) / self.cfg.train.gradient_accumulation_steps

    def figures(self) -> dict:
        """The step's ``rewards/*`` (:data:`FIGURES`; TRL's: its logged mean of the step's micro-batch means),
        then the next step's start."""
        if self.name == "onegpu":
            f = self.take()
            return {k: f[k] for k in FIGURES}
        m = self.trainer._metrics["train"]
        out = {k: sum(m[k]) / len(m[k]) for k in FIGURES}
        m.clear()
        return out

    def saved_bytes(self, batch: dict) -> int:
        """Bytes one micro-batch saves for backward (the loss's whole forward: the policy's; the reference's
        runs without autograd)."""
        from onegpu.measure import memory
        arm = self

        class Call:  # memory.saved_bytes' view: a model whose forward is the arm's loss
            parameters, train, eval = arm.model.parameters, arm.model.train, arm.model.eval

            @property
            def training(self):
                return arm.model.training

            def __call__(self, **features):
                return arm.loss({**features, **({"labels": batch["labels"]} if arm.name == "onegpu" else {})}, 1)
        return memory.saved_bytes(Call(), {**batch, "labels": batch.get("labels")}, lambda out, labels: out)[
            "activations"]


def base_model(cfg, tok, path):
    """The job's model as both arms start it: seeded, LoRA applied (for ``model.task``), no KV cache, dropout off
    (bench/vs_trl_grpo.py's arms too)."""
    import transformers

    from onegpu.models import loader, lora
    transformers.set_seed(cfg.train.seed)
    model = loader.build_causal_lm(path, tok, cfg.model, cfg.data.max_length, 0.0)
    if cfg.model.lora_adapters is not None:
        model = lora.apply(model, cfg.model.lora_adapters, cfg.model.task)
    loader.no_kv_cache(model)
    return model


def train_arm(arm: Arm, steps, device: str, digests: list[str]) -> dict:
    """The steps of ``arm``: its per-step loss, grad_norm, figures and wall time, its peak and saved bytes."""
    import torch

    from bench.vs_trl import _peak, _peak_reset
    opt = torch.optim.AdamW([p for p in arm.model.parameters() if p.requires_grad], lr=arm.cfg.train.learning_rate)
    saved = max(arm.saved_bytes(arm.batch(mb, device)) for mb in steps[0])
    arm.figures()  # (the probe's figures dropped)
    seen, rows = [], []
    base = _peak_reset(device)
    for step in steps:
        start = time.perf_counter()
        loss = torch.zeros((), device=device)
        for mb in step:
            seen.append(digest(mb))
            part = arm.loss(arm.batch(mb, device), sum(len(m) for m in step))
            part.backward()
            loss += part.detach()
        norm = torch.nn.utils.clip_grad_norm_(arm.model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        rows.append({"loss": float(loss), "grad_norm": float(norm), **arm.figures(),
                     "step_time_s": time.perf_counter() - start})
    if seen != digests:
        raise AssertionError(f"{arm.name} trained on other micro-batches than the list")
    return {"rows": rows, "saved_bytes": saved, "peak_bytes": _peak(device, base), "device": device}


def largest_differences(a: list[dict], b: list[dict]) -> dict:
    """The largest difference of ``a``'s per-step values from ``b``'s: relative for loss and grad_norm,
    absolute for the figures."""
    out = {k: max(abs(x[k] - y[k]) / abs(y[k]) for x, y in zip(a, b)) for k in ("loss", "grad_norm")}
    out.update({k: max(abs(x[k] - y[k]) for x, y in zip(a, b)) for k in FIGURES})
    return out


def bf16_minus_fp32(runs: dict) -> dict:
    """Per arm, per step: its bf16-autocast run's values minus its fp32 run's (first repetitions, signed, in the
    values' units: loss in nats, rewards in beta-scaled nats, accuracies as a share of pairs):
    ``{arm: [{key: difference} per step]}``. Only a difference: bf16 is not claimed to equal fp32."""
    return {a: [{k: b[k] - f[k] for k in KEYS} for b, f in zip(runs[a + BF16][0]["rows"], runs[a][0]["rows"])]
            for a in ARMS}


def precision_lines(runs: dict) -> list[str]:
    """The ``--bf16`` part of the Markdown: per step and arm, bf16 minus fp32 (:func:`bf16_minus_fp32`) beside the
    fp32 values, and the largest differences per arm and between the two bf16 runs."""
    from onegpu.formatting import markdown_table
    diff = bf16_minus_fp32(runs)
    rows = [[i + 1, a, f"{runs[a][0]['rows'][i]['loss']:.7f}", f"{runs[a][0]['rows'][i]['grad_norm']:.7f}"]
            + [f"{d[k]:+.2e}" for k in KEYS] for a in ARMS for i, d in enumerate(diff[a])]
    largest = {a: largest_differences(runs[a + BF16][0]["rows"], runs[a][0]["rows"]) for a in ARMS}
    both = largest_differences(runs["onegpu" + BF16][0]["rows"], runs["trl" + BF16][0]["rows"])

    def words(d: dict) -> str:
        return (f"loss {d['loss']:.1e} and grad_norm {d['grad_norm']:.1e} relative, "
                + ", ".join(f"{k} {d[k]:.1e}" for k in FIGURES) + " absolute")
    return ["bf16 autocast against fp32, each arm against itself on the same micro-batches from the same weights "
            "(bf16 minus fp32, per step; a difference, not a tolerance check):", "",
            markdown_table(["step", "arm", "loss fp32", "grad_norm fp32"] + [f"{k} bf16 - fp32" for k in KEYS], rows),
            "", "Largest |bf16 - fp32|: " + "; ".join(f"{a} {words(largest[a])}" for a in ARMS) + ". onegpu against "
            f"TRL, both in bf16: {words(both)}.", ""]


def memory_rows(runs: dict) -> list[list]:
    """Per run: saved bytes of one micro-batch (MiB) and against TRL's in the same precision, peak (MiB), steady
    step time (s, steps 2..N) min-max over the repetitions."""
    from onegpu.formatting import mib, ratio

    def steady(r: dict) -> float:
        t = [x["step_time_s"] for x in r["rows"][1:]] or [r["rows"][0]["step_time_s"]]
        return sum(t) / len(t)

    def trl(n: str) -> int:  # TRL's saved bytes in the run's precision
        return runs["trl" + BF16 if n.endswith(BF16) else "trl"][0]["saved_bytes"]
    return [[n, mib(runs[n][0]["saved_bytes"], unit=False), ratio(runs[n][0]["saved_bytes"] / trl(n)),
             mib(max(r["peak_bytes"] for r in runs[n]), unit=False),
             f"{min(steady(r) for r in runs[n]):.2f}-{max(steady(r) for r in runs[n]):.2f}"] for n in runs]


def report_lines(args, runs: dict, digests: list[str], load: list[float],
                 model: str = "SmolLM2-135M-Instruct") -> list[str]:
    """The Markdown: the micro-batches, the per-step table of both arms in fp32, with ``--bf16`` each arm's bf16
    run against its fp32 run (:func:`precision_lines`), the memory and time table (``model``: the model in
    words, :func:`bench.vs_trl.model_name`)."""
    from onegpu.formatting import markdown_table
    first = {a: runs[a][0]["rows"] for a in ARMS}
    step_rows = [[i + 1] + [f"{first[a][i][k]:.7f}" for k in KEYS for a in ARMS] for i in range(args.steps)]
    d = largest_differences(first["onegpu"], first["trl"])
    peak = ("the CUDA allocator's peak allocated above the run's start" if runs["onegpu"][0].get("device", "")
            .startswith("cuda") else "the resident set's high-water mark above the run's start")
    precision = "fp32, and each arm again under bf16 autocast" if args.bf16 else "fp32"
    return [f"{model}, {'LoRA r=' + str(args.lora) if args.lora else 'every weight'}, data.max_length "
            f"{args.max_length}, {args.steps} steps of {args.micro} x {args.accum} pairs, lr {args.lr}, {precision}, "
            f"dropout off, beta 0.1, sigmoid; the same {len(digests)} micro-batches in every run (SHA-256 of the "
            f"pairs' ids, first {digests[0]}, last {digests[-1]}); {args.reps} repetitions, runs rotating.", "",
            markdown_table(["step"] + [f"{k} {a}" for k in KEYS for a in ARMS], step_rows),
            "", f"Largest differences, onegpu against TRL in fp32: loss {d['loss']:.1e} and grad_norm "
            f"{d['grad_norm']:.1e} relative, " + ", ".join(f"{k} {d[k]:.1e}" for k in FIGURES) + " absolute.", "",
            *(precision_lines(runs) if args.bf16 else []),
            markdown_table(["run", "saved for backward, one micro-batch (MiB)", "vs trl (same precision)",
                            "peak (MiB)", "steady step (s), min-max"], memory_rows(runs)), "",
            f"Peak: {peak}. Load average during the run: {min(load):.2f}-{max(load):.2f} (the machine's cores: "
            f"{os.cpu_count()})."]


def main() -> None:
    from bench.arms import release_memory
    from bench.reporting import report
    from bench.vs_trl import alternate, bench_args, model_name, the_steps
    args = bench_args(__doc__, lr=5e-4)
    cfg = dpo_cfg(args)
    device, steps, tok, path, digests = the_steps(args, cfg, micro_batches, digest)

    def one(name: str) -> dict:
        arm = Arm(name.removesuffix(BF16), base_model(cfg, tok, path), cfg, tok, device, name.endswith(BF16))
        result = train_arm(arm, steps, device, digests)
        del arm
        release_memory()
        return result
    runs, load = alternate(args, run_names(args.bf16), one)
    report("vs_trl_dpo", args, "onegpu's DPO and TRL's DPOTrainer on the same preference micro-batches",
           report_lines(args, runs, digests, load, model_name(args, path)),
           {"digests": digests, "runs": runs, **({"bf16_minus_fp32": bf16_minus_fp32(runs)} if args.bf16 else {})})


if __name__ == "__main__":
    main()
