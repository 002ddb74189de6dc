"""onegpu's GRPO step against TRL's ``GRPOTrainer`` on the same generations and micro-batches: losses, figures,
memory, time.

The job of ``make grpo`` (docs/grpo.md): the packaged SmolLM2-135M-Instruct with LoRA r=8, the packaged sections
as prepare tokenizes them (``--max-length``), fp32, 4 completions a prompt of at most 16 tokens, temperature 0.7,
the rewards ``correctness`` and ``answer_mentioned``, ``loss_type`` dapo (TRL's default), ``num_iterations`` 1.
The generations are made once, before either arm trains: each step's prompts sampled from the starting policy
(:func:`onegpu.training.objectives.grpo_batch.build`: seeded by the step, scored, advantages over whole groups),
then fed to both arms (the SHA-256 of each step's completion ids is checked by each arm), so the arms differ only
in how they turn a micro-batch into its share of the step's loss:

- ``onegpu``: :func:`onegpu.training.objectives.grpo_batch.micro_batch_loss` (each micro-batch divided by the
  whole step's completion tokens, the fused LM head attached as ``train.fused_lm_head`` attaches it);
- ``trl``: a ``GRPOTrainer`` built on the same model, its ``_compute_loss`` on TRL's inputs of the micro-batch
  (``num_items_in_batch``: the step's completion tokens, as its ``training_step`` passes it).

Each optimizer step: ``--accum`` micro-batches of ``--micro`` completions, forward and backward each, gradient
clipping at 1.0, AdamW (torch, ``--lr``). Printed: per-step loss, grad_norm and ``clip_ratio/region_mean`` of each
arm and their largest differences, peak memory (CUDA allocated, else the resident set, above the run's start) and
steady step time (steps 2..N) min-max over ``--reps`` repetitions, arms rotating. Generation's own time is the
same for both (done once, outside the arms) and not compared. Results: ``bench/results/vs_trl_grpo[-tag].{md,json}``.

``--model DIR``: another causal LM directory in place of the packaged SmolLM2 (the GPU check's model); the device
is CUDA where torch sees one, else the CPU.

Run: ``python -m bench.vs_trl_grpo``.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
import time

ARMS = ("onegpu", "trl")
PACKAGED = "packaged:SmolLM2-135M-Instruct"
KEYS = ("loss", "grad_norm", "clip_ratio/region_mean")
GENERATIONS = 4  # completions a prompt (train.grpo.num_generations)


def grpo_cfg(args):
    """The GRPO job's ``Config`` from the options (``--max-length``, ``--rows``, ``--model``, ``--lora``, ``--micro``,
    ``--accum``, ``--steps``, ``--lr``)."""
    from onegpu.config import from_container
    return from_container({
        "data": {"source": "bbcnews-sections", "max_length": args.max_length, "max_train_samples": args.rows,
                 "max_eval_samples": 16},
        "model": {"task": "grpo", "name_or_path": getattr(args, "model", PACKAGED),
                  "lora": {"r": args.lora, "alpha": 2.0 * args.lora, "dropout": 0.0, "target_modules": None}
                  if args.lora else None},
        "train": {"backend": "accelerate", "per_device_train_batch_size": args.micro,
                  "gradient_accumulation_steps": args.accum, "max_steps": args.steps, "learning_rate": args.lr,
                  "logging_steps": 10**6, "seed": 42,
                  "grpo": {"num_generations": GENERATIONS, "max_completion_length": 16, "temperature": 0.7,
                           "reward_funcs": ["correctness", "answer_mentioned"]}}}, source="bench")


def generations(args, cfg, model, tok):
    """Each step's :class:`~onegpu.training.objectives.grpo_batch.StepBatch`, sampled from ``model`` (the starting
    policy) for the step's prompts in a seeded order, seed ``train.seed`` and the step as training seeds it."""
    import random

    from onegpu.data import pipeline
    from onegpu.training.objectives import generation, grpo_batch, reinforcement
    dsd, _, _, _ = pipeline.prepare(cfg, "prompt-answer", lambda texts: tok)
    train = dsd["train"]
    per_step = args.micro * args.accum // GENERATIONS
    order = list(range(len(train)))
    random.Random(42).shuffle(order)
    order = (order * (args.steps * per_step // len(order) + 1))[:args.steps * per_step]
    settings, funcs = reinforcement.settings_of(cfg), reinforcement.reward_funcs(cfg)
    out = []
    for s in range(args.steps):
        rows = order[s * per_step:(s + 1) * per_step]
        out.append(grpo_batch.build(model, [train[i]["prompt"] for i in rows], [train[i]["prompt_ids"] for i in rows],
                                    {"answer": [train[i]["answer"] for i in rows]}, funcs, settings,
                                    lambda ids: tok.decode(ids, skip_special_tokens=True), tok.pad_token_id,
                                    generation.eos_ids(tok, model), cfg.train.seed * 1_000_003 + s + 1))
    return out


def digest(batch) -> str:
    """SHA-256 (16 hex digits) of a step's completion ids."""
    return hashlib.sha256(str(batch.gens.completion_ids.tolist()).encode()).hexdigest()[:16]


class Arm:
    """One arm's model and how it computes a micro-batch's share of the step's loss and the step's figures."""

    def __init__(self, name: str, model, cfg, tok, device: str):
        from onegpu.training.objectives import lm_head, reinforcement
        self.name, self.cfg, self.device = name, cfg, device
        self.settings = reinforcement.settings_of(cfg)
        if name == "onegpu":
            lm_head.attach(model)
            self.model = model.to(device).train()
            return
        from datasets import Dataset
        from trl import GRPOConfig, GRPOTrainer
        g = cfg.train.grpo
        self._out = tempfile.TemporaryDirectory(prefix="onegpu-vs-trl-grpo-")
        targs = GRPOConfig(output_dir=self._out.name,
                           per_device_train_batch_size=cfg.train.per_device_train_batch_size,
                           gradient_accumulation_steps=cfg.train.gradient_accumulation_steps,
                           num_generations=g.num_generations, max_completion_length=g.max_completion_length,
                           temperature=g.temperature, beta=0.0, report_to=[], use_cpu=device == "cpu", bf16=False)
        self.trainer = GRPOTrainer(model=model.to(device), reward_funcs=[lambda prompts, completions, **k: [0.0] *
                                                                         len(completions)], args=targs,
                                   train_dataset=Dataset.from_dict({"prompt": ["x"] * 8}), processing_class=tok)
        self.trainer.current_gradient_accumulation_steps = cfg.train.gradient_accumulation_steps
        self.model = self.trainer.model.train()

    def step(self, batch) -> tuple[float, float]:
        """The step's micro-batches forward and backward: ``(loss, clip_ratio/region_mean)``."""
        import torch

        from onegpu.training.objectives import grpo_batch
        a = self.cfg.train.gradient_accumulation_steps
        n = batch.rows // a
        rows = [torch.arange(i * n, (i + 1) * n, device=self.device) for i in range(a)]
        g, loss = batch.gens, 0.0
        if self.name == "onegpu":
            counts, figures = grpo_batch.counts(batch, rows), grpo_batch.Figures()
            for r in rows:
                part = grpo_batch.micro_batch_loss(self.model, batch, r, counts, self.settings, figures)
                part.backward()
                loss += float(part.detach())
            return loss, figures.values(0.0)["clip_ratio/region_mean"]
        self.trainer._metrics["train"].clear()
        for r in rows:
            part = self.trainer._compute_loss(self.model, {
                "prompt_ids": g.prompt_ids[r], "prompt_mask": g.prompt_mask[r], "completion_ids": g.completion_ids[r],
                "completion_mask": g.completion_mask[r], "advantages": batch.advantages[r],
                "num_items_in_batch": g.completion_mask.sum()})
            part.backward()
            loss += float(part.detach())
        values = self.trainer._metrics["train"]["clip_ratio/region_mean"]
        return loss, sum(values) / len(values)


def train_arm(arm: Arm, batches, digests: list[str]) -> dict:
    """The steps of ``arm`` on ``batches``: its per-step loss, grad_norm, figure and wall time, and its peak."""
    import torch

    from bench.vs_trl import _peak, _peak_reset
    if [digest(b) for b in batches] != digests:
        raise AssertionError(f"{getattr(arm, 'name', arm)} was given other generations than the list")
    opt = torch.optim.AdamW([p for p in arm.model.parameters() if p.requires_grad], lr=arm.cfg.train.learning_rate)
    base, rows = _peak_reset(arm.device), []
    for batch in batches:
        start = time.perf_counter()
        loss, clipped = arm.step(batch)
        norm = torch.nn.utils.clip_grad_norm_(arm.model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        rows.append({"loss": loss, "grad_norm": float(norm), "clip_ratio/region_mean": clipped,
                     "step_time_s": time.perf_counter() - start})
    return {"rows": rows, "peak_bytes": _peak(arm.device, base), "device": arm.device}


def run_line(r: dict) -> str:
    """One repetition's progress line: its losses, peak and step times."""
    return (f"losses {[round(x['loss'], 6) for x in r['rows']]}, peak {r['peak_bytes'] / 2**20:.0f} MiB, steps "
            f"{[round(x['step_time_s'], 2) for x in r['rows']]} s")


def report_lines(args, runs: dict, digests: list[str], load: list[float], model: str) -> list[str]:
    """The Markdown: the per-step table of both arms, their largest differences, peak and step time."""
    from onegpu.formatting import markdown_table, mib
    first, device = {a: runs[a][0]["rows"] for a in ARMS}, runs["onegpu"][0]["device"]
    rows = [[i + 1] + [f"{first[a][i][k]:.8f}" for k in KEYS for a in ARMS] for i in range(args.steps)]
    rel = {k: max(abs(x[k] - y[k]) / max(abs(y[k]), 1e-12) for x, y in zip(first["onegpu"], first["trl"]))
           for k in KEYS[:2]}
    absolute = {k: max(abs(x[k] - y[k]) for x, y in zip(first["onegpu"], first["trl"])) for k in KEYS}

    def steady(r: dict) -> float:
        t = [x["step_time_s"] for x in r["rows"][1:]] or [r["rows"][0]["step_time_s"]]
        return sum(t) / len(t)
    cost = [[a, mib(max(r["peak_bytes"] for r in runs[a]), unit=False),
             f"{min(steady(r) for r in runs[a]):.2f}-{max(steady(r) for r in runs[a]):.2f}"] for a in ARMS]
    return [f"{model}, {'LoRA r=' + str(args.lora) if args.lora else 'every weight'}, data.max_length "
            f"{args.max_length}, {args.steps} steps of {args.micro} x {args.accum} completions ({GENERATIONS} a "
            f"prompt, at most 16 tokens, sampled once from the starting policy and fed to both arms: SHA-256 of the "
            f"steps' completion ids, first {digests[0]}, last {digests[-1]}), dapo, lr {args.lr}, fp32; "
            f"{args.reps} repetitions, arms rotating.", "",
            markdown_table(["step"] + [f"{k} {a}" for k in KEYS for a in ARMS], rows), "",
            f"Largest differences, onegpu against TRL: loss {absolute['loss']:.1e} absolute ({rel['loss']:.1e} "
            f"relative), grad_norm {rel['grad_norm']:.1e} relative, clip_ratio/region_mean "
            f"{absolute['clip_ratio/region_mean']:.1e} absolute.", "",
            markdown_table(["arm", "peak (MiB)", "steady step (s), min-max"], cost), "",
            f"Peak: above the run's start ({'CUDA allocated' if device == 'cuda' else 'the resident set'}). "
            f"Load average during the run: {min(load):.2f}-{max(load):.2f} (the machine's cores: {os.cpu_count()})."]


def main() -> None:
    import torch

    from bench.arms import release_memory, rotated, run_reps
    from bench.reporting import report
    from bench.vs_trl import bench_args, model_name
    from bench.vs_trl_dpo import base_model
    from onegpu.models import loader
    args = bench_args(__doc__, lr=2e-4)
    cfg = grpo_cfg(args)
    path = loader.resolve_model_path(cfg.model.name_or_path)
    tok = loader.load_tokenizer(path, "grpo")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    batches = generations(args, cfg, base_model(cfg, tok, path).to(device), tok)
    digests = [digest(b) for b in batches]

    def one(name: str) -> dict:
        arm = Arm(name, base_model(cfg, tok, path), cfg, tok, device)
        result = train_arm(arm, batches, digests)
        del arm
        release_memory()
        return result
    load = [os.getloadavg()[0]]

    def timed(name: str) -> dict:
        result = one(name)
        load.append(os.getloadavg()[0])
        return result
    runs = run_reps(args, lambda rep: rotated(list(ARMS), rep), timed, run_line, clean=False)
    report("vs_trl_grpo", args, "onegpu's GRPO step and TRL's GRPOTrainer on the same generations and micro-batches",
           report_lines(args, runs, digests, load, model_name(args, path)), {"digests": digests, "runs": runs})


if __name__ == "__main__":
    main()
