"""Data-parallel pieces on a CPU: two gloo processes (``torch.multiprocessing.spawn``) running the
accelerate backend's forward/backward of one optimizer step, and the launch helpers' checks.

Real runs through ``onegpu train`` under torch.distributed.run: tests/integration/test_data_parallel.py.
"""
from __future__ import annotations

import functools
import json
import math
import socket

import pytest

from onegpu.errors import ConfigError
from onegpu.training.parallel import distributed

torch = pytest.importorskip("torch")

# Each rank's two micro-batches (features, labels); -100 = an ignored label, so the ranks hold different
# numbers of items (5 and 3) and a per-rank mean would weight them unequally.
DATA = {
    0: [([[1.0, 0.0, 2.0, 1.0], [0.5, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 3.0]], [0, 2, 1]),
        ([[2.0, 1.0, 0.0, 0.5], [1.0, 1.0, 1.0, 1.0]], [1, 0])],
    1: [([[0.0, 2.0, 2.0, 0.0], [3.0, 0.0, 0.0, 1.0], [1.0, 0.5, 0.5, 0.0]], [2, -100, -100]),
        ([[0.0, 0.0, 0.0, 1.0], [2.0, 2.0, 0.0, 0.0]], [0, 1])],
}


class _Linear(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 3)

    def forward(self, input_ids):
        return {"logits": self.lin(input_ids)}


def _micro_batches(rank: int) -> list[dict]:
    return [{"input_ids": torch.tensor(x), "labels": torch.tensor(y)} for x, y in DATA[rank]]


def _all_reduce_part(rank: int, out: str) -> None:
    """The accelerate backend's forward/backward of one optimizer step on rank ``rank`` of 2; writes
    ``<out>.json``: the all-reduces counted, the summed loss, the gradients and the summed item count."""
    from accelerate import Accelerator
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    from onegpu.training import objectives
    from onegpu.training.backends.accelerate import _forward_backward
    from onegpu.training.objectives import count_items
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(_Linear())
    calls = []

    def counting_allreduce(state, bucket):  # the gradient all-reduce, counted
        calls.append(1)
        return allreduce_hook(None, bucket)

    model.register_comm_hook(None, counting_allreduce)
    batches = _micro_batches(rank)
    num_items = distributed.sum_over_ranks(sum(count_items(b["labels"], "sequence-classification")
                                               for b in batches))
    share = _forward_backward(accelerator, model, batches, num_items,
                              objectives.get("sequence-classification").step_loss, 1, None, 1)
    loss = distributed.sum_over_ranks(share.detach().clone())
    grads = [p.grad.tolist() for p in model.parameters()]
    with open(f"{out}.json", "w") as f:
        json.dump({"allreduce_calls": len(calls), "loss": loss.item(), "grads": grads,
                   "num_items": int(num_items)}, f)


def _oom_retry_part(rank: int, out: str, inject_rank: int = 1) -> None:
    """The trainer backend on rank ``rank`` of 2 (tiny BERT of tests/unit/tiny.py, 2 steps of 4 x 2 x 2),
    twice in one process group: first plain, then with rank ``inject_rank`` running out of memory
    (injected) in step 1's last micro-batch and re-splitting alone. Writes ``<out>.json``:
    ``{"plain": {...}, "retried": {...}}``, each the run's loss, grad_norm and events."""
    distributed.TIMEOUT_S = 60  # a desynchronised all-reduce fails the test in a minute, not ten
    from onegpu.config import from_container
    from onegpu.training.backends import hf_trainer
    from onegpu.training.backends.base import TrainRequest
    from tests.unit import tiny as tb
    cfg = from_container({"model": {"dropout": 0.0}, "train": {
        "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "max_steps": 2, "num_processes": 2,
        "learning_rate": 1e-3, "seed": 7, "logging_steps": 1}}, source="test")
    result = {}
    for name, injected in (("plain", -1), ("retried", inject_rank)):
        calls = []

        def injector(step: int, rows: int, calls: list = calls, injected: int = injected) -> bool:
            calls.append((step, rows))
            return rank == injected and step == 1 and rows == 4 and len(calls) == 2

        model, steps = hf_trainer.train(TrainRequest(tb.tiny_bert(), tb.tokenizer(), tb.dataset(32), cfg,
                                                     sink=lambda m, s: None, oom_injector=injector))
        result[name] = {"loss": [r["loss"] for r in steps.rows], "grad_norm": [r["grad_norm"] for r in steps.rows],
                        "events": steps.events}
    with open(f"{out}.json", "w") as f:
        json.dump(result, f)


def _validation_cfg(processes: int):
    from onegpu.config import from_container
    micro = 8 // processes  # effective batch 8: 2 processes x 4, or 1 x 8
    return from_container({"model": {"dropout": 0.0}, "evaluate": {"per_device_eval_batch_size": 3}, "train": {
        "per_device_train_batch_size": micro, "gradient_accumulation_steps": 1, "max_steps": 2,
        "num_processes": processes, "learning_rate": 1e-3, "seed": 7, "eval_steps": 1}}, source="test")


def _validation_data():
    """32 training rows and a validation split of 7 (batches of 3, 3 and an uneven 1)."""
    from datasets import DatasetDict

    from tests.unit import tiny as tb
    d = tb.dataset(40)["train"]
    return DatasetDict(train=d.select(range(32)), validation=d.select(range(32, 39)))


def _validation_part(rank: int, out: str) -> None:
    """The trainer backend on rank ``rank`` of 2, validating after each of 2 steps; writes ``<out>.json``:
    the validation points this rank logged and its step losses."""
    distributed.TIMEOUT_S = 60
    from onegpu.training.backends import hf_trainer
    from onegpu.training.backends.base import TrainRequest
    from onegpu.training.objectives import heldout
    from tests.unit import tiny as tb
    points, shares, own = [], [], heldout.shard
    heldout.shard = lambda ds: shares.append(len(own(ds))) or own(ds)  # the rows this rank reads per point
    _, steps = hf_trainer.train(TrainRequest(tb.tiny_bert(), tb.tokenizer(), _validation_data(), _validation_cfg(2),
                                             sink=lambda m, s: points.append((s, m)) if "eval_loss" in m else None))
    with open(f"{out}.json", "w") as f:
        json.dump({"points": points, "shares": shares, "loss": [r["loss"] for r in steps.rows]}, f)


DPO_FIGURES = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")


def _dpo_train(processes: int, sink=None):
    """DPO with the trainer backend on a tiny Llama (its reference a frozen copy), 2 steps of 8 pairs (2 x 2 x 2
    or 4 x 2): the recorder's rows."""
    from onegpu.config import from_container
    from onegpu.training import objectives
    from onegpu.training.backends import hf_trainer
    from onegpu.training.backends.base import TrainRequest
    from onegpu.training.objectives import lm_head
    from tests.unit.equivalence import float64
    from tests.unit.training.objectives.test_batches import tiny_llama
    cfg = from_container({"data": {"source": "pairs.jsonl"}, "model": {"task": "preference", "name_or_path": None},
                          "train": {"per_device_train_batch_size": 4 // processes, "gradient_accumulation_steps": 2,
                                    "max_steps": 2, "num_processes": processes, "learning_rate": 1e-2, "seed": 7,
                                    "eval_strategy": "no"}}, source="test")
    model = tiny_llama()
    lm_head.attach(model)
    objectives.get("preference").prepare_model(model, cfg)
    _, steps = hf_trainer.train(TrainRequest(model, float64.chat_tokenizer(), float64.preference_data(16), cfg,
                                             sink=sink or (lambda m, s: None)))
    return [{k: r[k] for k in DPO_FIGURES} for r in steps.rows]


def _dpo_part(rank: int, out: str) -> None:
    """DPO on rank ``rank`` of 2; writes ``<out>.json``: its rows."""
    distributed.TIMEOUT_S = 60
    with open(f"{out}.json", "w") as f:
        json.dump({"rows": _dpo_train(2)}, f)


# train.fsdp's proof: (rows per micro-batch of each of 2 processes, accumulation, its keys besides enabled, the
# train keys) of each case; the second with activation checkpointing, gathered weights kept until backward, and
# clipping that acts (the norm is above 0.5). The fused-* cases: a case with the fused LM head (its tiles project
# with the root's gathered head after the forward; validation scores through the root's hooks), else the same.
FSDP_CASES = {"accum1": (2, 1, {"reshard_after_forward": True}, {}),
              "accum4": (1, 4, {"reshard_after_forward": False}, {"gradient_checkpointing": True,
                                                                   "max_grad_norm": 0.5}),
              "lora": (1, 2, {"reshard_after_forward": True}, {"gradient_checkpointing": True}),
              "validation": (1, 1, {"reshard_after_forward": True}, {
                  "eval_strategy": "steps", "eval_steps": 1, "load_best_model_at_end": True,
                  "metric_for_best_model": "eval_loss", "greater_is_better": True})}
FSDP_CASES.update({f"fused-{case}": (*FSDP_CASES[case][:3], {**FSDP_CASES[case][3], "fused_lm_head": True})
                   for case in ("validation", "accum4")})


def _fsdp_train(processes: int, case: str, save_to: str | None = None) -> dict:
    """2 optimizer steps of the accelerate backend on a tiny Llama in float64 (whole logits unless the case turns
    the fused LM head on; answers of 1..9 words: uneven targets per micro-batch), 2 x micro x accumulation rows per
    step: ``processes`` 2 with ``train.fsdp``, 1 without (micro-batches of 2 x micro).
    Returns the rows' loss and grad_norm, the trained weights (rank 0; {} on the others), FSDP2's gradient
    reduce-scatters counted, and what each rank held at step 1 (:func:`_held`: its gradients' local-shard norm,
    parameter elements, every gradient made whole, whether the head is still the embedding's tensor)."""
    from datasets import DatasetDict
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    from onegpu.config import from_container
    from onegpu.training import validation
    from onegpu.training.backends import accelerate as backend
    from onegpu.training.backends.base import TrainRequest
    from onegpu.training.objectives import lm_head
    from tests.unit.equivalence import float64
    from tests.unit.training.objectives.test_batches import tiny_llama
    micro, accum, fsdp, train = FSDP_CASES[case]
    lora_cfg = {"lora": {"r": 4, "alpha": 8.0}} if case == "lora" else {}
    cfg = from_container({"data": {"max_length": 64}, "model": {"task": "causal-lm", "name_or_path": None,
                                                                  "dropout": 0.0, **lora_cfg},
                          "train": {"backend": "accelerate", "per_device_train_batch_size": micro * 2 // processes,
                                    "gradient_accumulation_steps": accum, "max_steps": 2, "num_processes": processes,
                                    "optim": "sgd", "learning_rate": 0.05, "weight_decay": 0.01, "seed": 3,
                                    "max_grad_norm": 0.0, "eval_strategy": "no", "oom_retry": False,
                                    "fused_lm_head": False,
                                    "fsdp": {"enabled": processes > 1, **fsdp}, **train},
                          "evaluate": {"per_device_eval_batch_size": 2}}, source="test")
    model = tiny_llama().double()
    if cfg.train.fused_lm_head:  # as session.build_model attaches it
        lm_head.check(model, "tiny Llama")
        lm_head.attach(model)
    if case == "lora":  # adapters on every linear layer, B non-zero: their gradients reach every matrix
        from onegpu.config import LoraConfig
        from onegpu.models import lora
        torch.manual_seed(1)
        model = lora.apply(model, LoraConfig(r=4, alpha=8.0), "causal-lm", True)
        for n, p in model.named_parameters():
            if "lora_B" in n:
                torch.nn.init.normal_(p, std=0.02)
    data = float64.instruction_data("answers", 4 * micro * accum)
    if cfg.train.eval_strategy == "steps":  # 5 rows: shares of 2 and 3, one and two batches of 2 (a filler first)
        data = DatasetDict(train=data["train"], validation=float64.instruction_data("answers", 5)["train"])
    held = {}

    def hold(optimizer, args, kwargs):  # step 1: this rank's shards of the gradients and parameters
        if not held:
            held.update(_held(optimizer, model))
    handle = register_optimizer_step_pre_hook(hold)
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group
    own_reduce, reduces = group.foreach_reduce, []
    group.foreach_reduce = lambda *a, **kw: reduces.append(1) or own_reduce(*a, **kw)  # a group's gradients
    try:
        with float64.float64_throughout(model):
            trained, steps = validation.finish(*backend.train(TrainRequest(model, float64.chat_tokenizer(), data,
                                                                           cfg, sink=lambda m, s: None)))
    finally:
        handle.remove()
        group.foreach_reduce = own_reduce
    if case == "lora" and distributed.is_main():  # as the train stage writes models/: the adapter, then merged
        from onegpu.models import lora
        tokenizer = float64.chat_tokenizer()
        trained = lora.save(trained, tokenizer, f"{save_to}-adapter") if save_to else trained.merge_and_unload()
    weights = {n: p.detach().clone() for n, p in trained.named_parameters()} if distributed.is_main() else {}
    if save_to and distributed.is_main():  # as the train stage writes models/ (rank 0)
        trained.save_pretrained(save_to)
    return {"rows": [{k: r[k] for k in ("loss", "grad_norm")} for r in steps.rows], "weights": weights,
            "reduce_scatters": len(reduces), "best": steps.best,
            "evals": [(e["step"], e["eval_loss"], e["eval_rows"]) for e in steps.evals], **held}


def _held(optimizer, model) -> dict:
    """What this rank holds as an optimizer step starts: its gradients' local-shard norm, its parameters' elements
    and theirs whole, whether all are DTensors, every gradient made whole (a collective) under its parameter's name,
    and whether the output layer is still the embedding's tensor (tied)."""
    from torch.distributed.tensor import DTensor

    from onegpu.training.objectives import lm_head
    from tests.unit.equivalence import float64
    params = [p for g in optimizer.param_groups for p in g["params"]]
    local = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params]
    names = {id(p): float64._name(model, n) for n, p in model.named_parameters()}
    inner = lm_head._inner(model)
    return {"local_norm": float(torch.linalg.vector_norm(torch.stack([g.norm() for g in local]))),
            "local_elements": sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in params),
            "elements": sum(p.numel() for p in params), "dtensors": all(isinstance(p, DTensor) for p in params),
            "grads": {names[id(p)]: float64._whole(p.grad).detach().clone() for p in params},
            "tied": inner.get_output_embeddings().weight is inner.get_input_embeddings().weight}


def _bf16_train(sharded: bool) -> dict:
    """3 AdamW steps of the accelerate backend on a float32 tiny Llama under bf16 autocast (accelerate's, as
    without sharding), 2 processes x 1 x 2: sharded with ``train.fsdp`` or plain data parallel. Returns the rows'
    loss and grad_norm and (rank 0) the trained weights."""
    from onegpu.config import from_container
    from onegpu.training.backends import accelerate as backend
    from onegpu.training.backends.base import TrainRequest
    from tests.unit.equivalence import float64
    from tests.unit.training.objectives.test_batches import tiny_llama
    cfg = from_container({"data": {"max_length": 64}, "model": {"task": "causal-lm", "name_or_path": None,
                                                                  "dropout": 0.0},
                          "train": {"backend": "accelerate", "per_device_train_batch_size": 1, "bf16": True,
                                    "gradient_accumulation_steps": 2, "max_steps": 3, "num_processes": 2,
                                    "optim": "adamw_torch", "learning_rate": 1e-3, "seed": 3, "max_grad_norm": 1.0,
                                    "eval_strategy": "no", "oom_retry": False, "fused_lm_head": False,
                                    "fsdp": {"enabled": sharded}}}, source="test")
    trained, steps = backend.train(TrainRequest(tiny_llama(), float64.chat_tokenizer(),
                                                float64.instruction_data("answers", 12), cfg, sink=lambda m, s: None))
    weights = {n: p.detach().float().tolist() for n, p in trained.named_parameters()} if distributed.is_main() else {}
    return {"rows": [{k: r[k] for k in ("loss", "grad_norm")} for r in steps.rows], "weights": weights}


def _fsdp_bf16_part(rank: int, out: str) -> None:
    """bf16 autocast on rank ``rank`` of 2: sharded twice, then plain data parallel; writes ``<out>.json``."""
    distributed.TIMEOUT_S = 60
    runs = {"sharded": _bf16_train(True), "again": _bf16_train(True), "data_parallel": _bf16_train(False)}
    with open(f"{out}.json", "w") as f:
        json.dump(runs, f)


def _fsdp_part(rank: int, out: str) -> None:
    """train.fsdp on rank ``rank`` of 2, each case of :data:`FSDP_CASES`; writes ``<out>.json`` (the rows and
    what the rank held) and ``<out>.pt`` (each case's trained weights, rank 0's alone, and step-1 gradients)."""
    distributed.TIMEOUT_S = 60
    results = {case: _fsdp_train(2, case, f"{out}-{case}-model") for case in FSDP_CASES}
    torch.save({case: {k: r.pop(k) for k in ("weights", "grads")} for case, r in results.items()}, f"{out}.pt")
    with open(f"{out}.json", "w") as f:
        json.dump(results, f)


def _fsdp_resume_train(out: str, run: str, stop=None, sink=None, world: int = 2,
                       ckpt: str | None = None) -> list[dict]:
    """4 optimizer steps of 4 examples (``world`` processes of 1 x 4 / ``world``) of the accelerate backend under
    train.fsdp on a tiny Llama in float64: AdamW (its moments in the checkpoint) under a linear schedule with
    warmup (the scheduler's state), a checkpoint every step (``save_steps`` 1) into ``ckpt`` (None: the folder
    :func:`_shared_checkpoints` names), resumed from the newest complete one there when ``run`` starts with
    ``resumed`` or ``from``; rank 0 writes models/ as the train stage does (``<out>-<run>-model``).
    Returns the recorder's rows (loss, grad_norm), restored ones included."""
    from onegpu.config import from_container
    from onegpu.training.backends import accelerate as backend
    from onegpu.training.backends.base import TrainRequest
    from onegpu.training.lifecycle.resume import latest_checkpoint
    from tests.unit.equivalence import float64
    from tests.unit.training.objectives.test_batches import tiny_llama
    cfg = from_container({"data": {"max_length": 64}, "model": {"task": "causal-lm", "name_or_path": None,
                                                                  "dropout": 0.0},
                          "train": {"backend": "accelerate", "per_device_train_batch_size": 1,
                                    "gradient_accumulation_steps": 4 // world, "max_steps": 4,
                                    "num_processes": world,
                                    "optim": "adamw_torch", "learning_rate": 0.01, "warmup_ratio": 0.34,
                                    "lr_scheduler_type": "linear", "weight_decay": 0.01, "seed": 3,
                                    "max_grad_norm": 1.0, "eval_strategy": "no", "oom_retry": False,
                                    "fused_lm_head": False, "save_steps": 1, "fsdp": {"enabled": True}}},
                         source="test")
    model = tiny_llama().double()
    ckpt = ckpt or (_shared_checkpoints(out) if run != "whole" else None)
    with float64.float64_throughout(model):
        trained, steps = backend.train(TrainRequest(
            model, float64.chat_tokenizer(), float64.instruction_data("answers", 12), cfg,
            sink=sink or (lambda m, s: None), checkpoint_dir=ckpt, stop=stop, checkpoint_meta={"run_id": "r1"},
            resume=latest_checkpoint(ckpt) if run.startswith(("resumed", "from")) else None))
    if distributed.is_main():
        trained.save_pretrained(f"{out}-{run}-model")
    return [{k: r[k] for k in ("loss", "grad_norm")} for r in steps.rows]


def _shared_checkpoints(out: str) -> str:
    """The checkpoint folder both ranks use (as the stage's, one per training): ``out`` without its ``-rank<r>``."""
    return out.rsplit("-rank", 1)[0] + "-checkpoints"


def _fsdp_resume_part(rank: int, out: str) -> None:
    """train.fsdp stopped after step 2 and resumed, on rank ``rank`` of 2, beside the uninterrupted run; writes
    ``<out>.json``: both runs' rows, the losses the stopped run logged, and the stopped run's checkpoint folders
    and files."""
    import os
    import shutil

    from tests.unit.tiny import interrupt_at_step_2
    distributed.TIMEOUT_S = 60
    whole = _fsdp_resume_train(out, "whole")
    ckpt = _shared_checkpoints(out)
    first, kept = interrupt_at_step_2(lambda sink, stop, **kw: _fsdp_resume_train(out, "stopped", stop, sink), ckpt)
    files = sorted(os.path.relpath(os.path.join(d, f), ckpt) for d, _, fs in os.walk(ckpt) for f in fs)
    if rank == 0:  # kept for the resume on 4 processes (test_a_sharded_checkpoint_resumes_on_another_number_...)
        shutil.copytree(ckpt, ckpt + "-of-2")
    resumed = _fsdp_resume_train(out, "resumed")
    with open(f"{out}.json", "w") as f:
        json.dump({"whole": whole, "first": first, "resumed": resumed, "files": files,
                   "kept": [kept.step, kept.sharded] if kept else None}, f)


def _fsdp_reshard_four_part(rank: int, out: str) -> None:
    """On rank ``rank`` of 4: the 2 processes' checkpoint of step 2 (``fsdp_resume``'s copy) resumed on 4 of
    1 x 1; then a run of 4 stopped during step 2, its checkpoint left for :func:`_fsdp_reshard_two_part`. Writes
    ``<out>.json``: the resumed rows, the stopped run's losses and the step and shards of its checkpoint."""
    from tests.unit.tiny import interrupt_at_step_2
    distributed.TIMEOUT_S = 60
    here = out.rsplit("/", 1)[0]
    resumed = _fsdp_resume_train(out, "from-2", world=4, ckpt=f"{here}/fsdp_resume-checkpoints-of-2")
    four = f"{here}/fsdp_reshard-checkpoints-of-4"
    first, kept = interrupt_at_step_2(
        lambda sink, stop, **kw: _fsdp_resume_train(out, "stopped", stop, sink, world=4, ckpt=four), four)
    with open(f"{out}.json", "w") as f:
        json.dump({"resumed": resumed, "first": first, "kept": [kept.step, kept.sharded] if kept else None}, f)


def _fsdp_reshard_two_part(rank: int, out: str) -> None:
    """On rank ``rank`` of 2: the 4 processes' checkpoint of step 2 resumed on 2 of 1 x 2; writes ``<out>.json``."""
    distributed.TIMEOUT_S = 60
    here = out.rsplit("/", 1)[0]
    resumed = _fsdp_resume_train(out, "from-4", world=2, ckpt=f"{here}/fsdp_reshard-checkpoints-of-4")
    with open(f"{out}.json", "w") as f:
        json.dump({"resumed": resumed}, f)


_PARTS = {"all_reduce": _all_reduce_part, "oom_retry": _oom_retry_part, "validation": _validation_part,
          "dpo": _dpo_part, "fsdp": _fsdp_part, "fsdp_resume": _fsdp_resume_part, "fsdp_bf16": _fsdp_bf16_part,
          "fsdp_reshard_four": _fsdp_reshard_four_part, "fsdp_reshard_two": _fsdp_reshard_two_part}


def _ranks(rank: int, ports: list[int], out_dir: str, parts: list[str], world: int = 2) -> None:
    """Rank ``rank`` of ``world`` runs ``parts`` (of ``_PARTS``) in turn, each in a process group of its own (on a
    port of its own) from a clean Accelerate state: the group destroyed and Accelerate's process-wide state
    reset after each. Part ``p`` writes ``<out_dir>/<p>-rank<r>.json``."""
    import gc
    import os

    from accelerate.state import AcceleratorState, GradientState
    for part, port in zip(parts, ports):
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        _PARTS[part](rank, f"{out_dir}/{part}-rank{rank}")
        gc.collect()  # the part's DDP model lets go of its process group
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


@pytest.fixture(scope="module")
def rank_results(request, tmp_path_factory) -> dict:
    """``{part: [rank 0's results, rank 1's]}`` from ONE pair of spawned gloo ranks (spawns cost more than
    the parts), running the part of each selected test below: the out-of-memory retry (slow) only when its
    test is selected. A part whose ranks failed maps to the error, which fails its test alone; the parts
    before it keep their results."""
    import torch.multiprocessing as mp
    tests = {"all_reduce": test_two_gloo_ranks_all_reduce_once_per_step_and_give_the_one_process_gradient,
             "oom_retry": test_an_out_of_memory_retry_on_one_rank_keeps_the_ranks_in_step_and_the_losses,
             "validation": test_two_processes_validate_as_one_each_its_share_of_the_split,
             "dpo": test_two_processes_train_dpo_as_one_the_figures_over_every_pair_once,
             "fsdp": test_fsdp2_over_two_processes_is_one_process_in_float64,
             "fsdp_resume": test_a_sharded_run_stopped_after_step_2_resumes_to_the_uninterrupted_run_in_float64,
             "fsdp_bf16": test_bf16_autocast_sharded_is_data_parallel_and_the_same_run_to_run}
    selected = {getattr(item, "originalname", None) for item in request.session.items}
    if test_a_sharded_checkpoint_resumes_on_another_number_of_processes_in_float64.__name__ in selected:
        selected.add(tests["fsdp_resume"].__name__)  # its checkpoint and uninterrupted run
    parts = [part for part, test in tests.items() if test.__name__ in selected] or list(tests)
    out = tmp_path_factory.mktemp("ranks")
    failure = None
    try:
        mp.spawn(_ranks, args=(_free_ports(len(parts)), str(out), parts), nprocs=2, join=True)
    except Exception as e:  # reported by the failed part's test
        failure = e
    results = {}
    for part in parts:
        files = [out / f"{part}-rank{r}.json" for r in (0, 1)]
        results[part] = [json.loads(f.read_text()) for f in files] if all(f.exists() for f in files) else failure
    results["fsdp_weights"] = out / "fsdp-rank0.pt"  # the fsdp part's trained weights (rank 0's)
    return results


def _part(rank_results: dict, part: str) -> list[dict]:
    got = rank_results[part]
    if isinstance(got, BaseException):
        raise got
    return got


@pytest.mark.slow
def test_an_out_of_memory_retry_on_one_rank_keeps_the_ranks_in_step_and_the_losses(rank_results):
    ranks = _part(rank_results, "oom_retry")  # one pair of processes trains both runs (spawns cost more)
    plain, retried = [r["plain"] for r in ranks], [r["retried"] for r in ranks]
    assert [len(r["events"]) for r in plain] == [0, 0]
    assert [len(r["events"]) for r in retried] == [0, 1]  # rank 1 alone re-split its micro-batches
    for a, b in zip(plain, retried):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
    assert plain[0]["loss"] == plain[1]["loss"]  # every rank logs the whole step's loss


def test_two_processes_validate_as_one_each_its_share_of_the_split(rank_results):
    """2 processes x 4 = 1 x 8: each process reads its share of the 7 validation rows (3 and 4: the second's
    last batch of 3 uneven; no row counted twice or left out), and both hold the one-process figures."""
    from onegpu.training.backends import hf_trainer
    from onegpu.training.backends.base import TrainRequest
    from tests.unit import tiny as tb
    ranks = _part(rank_results, "validation")
    assert [r["shares"] for r in ranks] == [[3, 3], [4, 4]]  # rows 0-2 and 3-6, at each of the 2 points
    figures = ("eval_loss", "eval_accuracy", "eval_f1_macro", "eval_rows")  # (runtime and peak are each rank's)
    assert [[(s, [m[k] for k in figures]) for s, m in r["points"]] for r in ranks] == [
        [(s, [m[k] for k in figures]) for s, m in ranks[0]["points"]]] * 2  # all-reduced: equal on every process
    one = []
    hf_trainer.train(TrainRequest(tb.tiny_bert(), tb.tokenizer(), _validation_data(), _validation_cfg(1),
                                  sink=lambda m, s: one.append((s, m)) if "eval_loss" in m else None))
    assert [s for s, _ in ranks[0]["points"]] == [s for s, _ in one] == [1, 2]
    for (_, two), (_, single) in zip(ranks[0]["points"], one):
        assert two["eval_rows"] == single["eval_rows"] == 7
        assert two["eval_loss"] == pytest.approx(single["eval_loss"], rel=1e-6)
        assert two["eval_accuracy"] == single["eval_accuracy"]


def test_two_processes_train_dpo_as_one_the_figures_over_every_pair_once(rank_results):
    """2 processes x 2 pairs x 2 = 1 x 4 x 2 per step: loss, grad_norm and TRL's figures (all-reduced sums over
    the step's 8 pairs) within 1e-5, the same on both processes."""
    ranks = _part(rank_results, "dpo")
    assert ranks[0]["rows"] == ranks[1]["rows"]
    one = _dpo_train(1)
    assert len(one) == len(ranks[0]["rows"]) == 2
    for two, single in zip(ranks[0]["rows"], one):
        for k in DPO_FIGURES:
            assert abs(two[k] - single[k]) <= 1e-5 * max(1.0, abs(single[k])), (k, two[k], single[k])


@pytest.mark.parametrize("case", list(FSDP_CASES))
def test_fsdp2_over_two_processes_is_one_process_in_float64(rank_results, tmp_path_factory, case):
    """train.fsdp: 2 gloo processes, each holding half of every weight and gradient (fully_shard per decoder
    layer and the root), = 1 process unsharded, per step within 1e-12 relative in float64: the loss, the
    global grad_norm before clipping, every parameter's step-1 gradient made whole, and every weight after the 2
    steps; at accumulation 1, at 4 with gradient checkpointing, reshard_after_forward false and clipping at 0.5,
    and with LoRA adapters (r=4 on every linear layer, the base frozen in the same shards) at 2 with checkpointing,
    models/ merged as the train stage merges it; with validation after every step (5 rows: uneven shares) and the
    best point's weights loaded at the end; and the last and the second with the fused LM head, each = 1 process
    with the fused head and = 1 with the whole logits, the head still the embedding's tensor on every rank. The
    logged norm is the global one: each rank's local-shard norm is another figure (a logged local norm would fail
    here), the two together make the whole. models/ as rank 0 writes it loads with from_pretrained, the trained
    weights to the bit."""
    from tests.unit.equivalence.float64 import REL
    ranks = _part(rank_results, "fsdp")
    two = [r[case] for r in ranks]
    train = FSDP_CASES[case][3]
    one = _one_process(case)
    assert all(r["dtensors"] and r["tied"] for r in two) and one["tied"]
    assert [r["local_elements"] * 2 for r in two] == [r["elements"] for r in two]
    assert two[0]["rows"] == two[1]["rows"] and len(one["rows"]) == 2
    # One reduce-scatter per sharded group (2 layers, the root) and step, whatever the accumulation: the
    # micro-batches before a step's last run under set_requires_gradient_sync(False) (DDP's no_sync: 4 per step).
    # Under LoRA the root's group (embeddings, norm, head) is frozen: nothing of it to reduce.
    groups = 2 if case == "lora" else 3
    assert [r["reduce_scatters"] for r in two] == [2 * groups, 2 * groups]
    # Validation during training: each process scores its share (2 and 3 of 5 rows; the first runs a filler
    # forward, as every sharded forward gathers with all), the figures all-reduced: one process's, per point.
    assert two[0]["evals"] == two[1]["evals"] and len(one["evals"]) == (2 if "eval_steps" in train else 0)
    assert all(rows == 5 for _, _, rows in one["evals"])
    if train.get("load_best_model_at_end"):  # models/ gets the best point's weights, gathered from the shards then
        assert one["best"]["step"] == two[0]["best"]["step"] == 1
    saved = torch.load(_fsdp_weights(rank_results), weights_only=True)[case]
    weights = saved["weights"]
    ones = {"one": one, **({"whole logits": _one_process(case.removeprefix("fused-"))} if "fused-" in case else {})}
    figures = {name: _same_as(two[0], saved["grads"], ref) for name, ref in ones.items()}  # fused: with and without
    if train.get("max_grad_norm"):
        assert one["rows"][0]["grad_norm"] > 0.5  # the clipping acted
    # Each rank's own shards' norm (of the gradients the optimizer steps with: clipped) is another figure;
    # together they make the whole.
    bound = train.get("max_grad_norm", 0.0)
    whole = one["rows"][0]["grad_norm"] * (min(1.0, bound / (one["rows"][0]["grad_norm"] + 1e-6)) if bound else 1.0)
    assert min(abs(r["local_norm"] - whole) for r in two) > 1e-3 * whole, [r["local_norm"] for r in two]
    assert abs(math.hypot(*(r["local_norm"] for r in two)) - whole) <= REL * whole
    assert weights.keys() == one["weights"].keys()
    worst = max(float((weights[n] - w).norm() / w.norm()) for n, w in one["weights"].items())
    assert worst <= REL, worst
    from transformers import LlamaForCausalLM  # models/ as written: a plain model that from_pretrained loads
    loaded = LlamaForCausalLM.from_pretrained(str(rank_results["fsdp_weights"].parent / f"fsdp-rank0-{case}-model"),
                                              dtype=torch.float64)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight  # tied, as trained
    assert all(torch.equal(p, weights[n]) for n, p in loaded.named_parameters())
    print(f"fsdp {case}: " + "; ".join(f"against {name}: loss {d['loss']:.1e}, grad_norm {d['grad_norm']:.1e}, "
                                       f"gradients {d['gradient']:.1e}" for name, d in figures.items())
          + f"; weights {worst:.1e} (relative)")


@functools.cache
def _one_process(case: str) -> dict:
    """:func:`_fsdp_train` of ``case`` on one process, once (a fused-* case's whole-logits twin is its case's)."""
    return _fsdp_train(1, case)


def _same_as(sharded: dict, grads: dict, one: dict) -> dict:
    """:func:`tests.unit.equivalence.float64.distance` of a sharded run (rank 0's rows and the step-1 gradients
    made whole) from one process's run, asserted within 1e-12 (loss, grad_norm, every gradient), and its validation
    points: the same steps and rows, the loss within 1e-12. Returns the distance."""
    from tests.unit.equivalence.float64 import REL, Run, distance
    d = distance(Run(sharded["rows"], grads), Run(one["rows"], one["grads"]))
    assert max(d["loss"], d["grad_norm"], d["gradient"]) <= REL, d
    assert [(s, n) for s, _, n in sharded["evals"]] == [(s, n) for s, _, n in one["evals"]]
    assert all(abs(a - b) <= REL * b for (_, a, _), (_, b, _) in zip(sharded["evals"], one["evals"])), one["evals"]
    return d


def test_a_sharded_run_stopped_after_step_2_resumes_to_the_uninterrupted_run_in_float64(rank_results):
    """train.fsdp, 2 gloo processes, AdamW with warmup, a checkpoint every step: stopped by a signal during step 2,
    every process writes its shards (torch.distributed.checkpoint) and the checkpoint of step 2 replaces step 1's;
    resumed on 2 processes, the per-step loss and grad_norm equal the uninterrupted run's within 1e-12 relative
    (step 4's loss reads the AdamW moments restored), and models/ of both, loaded by from_pretrained here (another
    process than the training's), are equal to the bit."""
    from transformers import LlamaForCausalLM

    from tests.unit.equivalence.float64 import REL
    ranks = _part(rank_results, "fsdp_resume")
    assert ranks[0]["resumed"] == ranks[1]["resumed"] and ranks[0]["whole"] == ranks[1]["whole"]
    got = ranks[0]
    assert got["kept"] == [2, 2]  # step 2's checkpoint, holding the shards of 2 processes
    assert not [f for f in got["files"] if f.startswith("checkpoint-1")]  # step 1's removed once step 2's was whole
    assert {"checkpoint-2/sharded/__0_0.distcp", "checkpoint-2/sharded/__1_0.distcp", "checkpoint-2/sharded/.metadata",
            "checkpoint-2/rng_state-rank0.pt", "checkpoint-2/rng_state-rank1.pt", "checkpoint-2/scheduler.pt",
            "checkpoint-2/onegpu_state.json"} <= set(got["files"]), got["files"]
    whole, resumed = got["whole"], got["resumed"]
    assert len(whole) == len(resumed) == 4 and [r["loss"] for r in whole[:2]] == got["first"]
    worst = {k: max(abs(a[k] - b[k]) / abs(b[k]) for a, b in zip(resumed, whole)) for k in ("loss", "grad_norm")}
    assert max(worst.values()) <= REL, worst
    out = rank_results["fsdp_weights"].parent
    one, two = (LlamaForCausalLM.from_pretrained(str(out / f"fsdp_resume-rank0-{run}-model"), dtype=torch.float64)
                for run in ("whole", "resumed"))
    assert all(torch.equal(p, q) for p, q in zip(one.parameters(), two.parameters()))
    print(f"fsdp resume: loss {worst['loss']:.1e}, grad_norm {worst['grad_norm']:.1e} (relative); models/ equal")


@pytest.fixture(scope="module")
def reshard_results(rank_results) -> dict:
    """``{part: [each rank's results]}`` of the resumes on another number of processes: 4 spawned gloo processes
    resume ``fsdp_resume``'s checkpoint of 2 and leave one of their own, which 2 processes resume."""
    import torch.multiprocessing as mp
    _part(rank_results, "fsdp_resume")  # its checkpoint, copied aside, and its uninterrupted run
    out = rank_results["fsdp_weights"].parent
    results = {}
    for part, world in (("fsdp_reshard_four", 4), ("fsdp_reshard_two", 2)):
        try:
            mp.spawn(_ranks, args=(_free_ports(1), str(out), [part], world), nprocs=world, join=True)
        except Exception as e:  # reported by the test
            return {"failure": e}
        results[part] = [json.loads((out / f"{part}-rank{r}.json").read_text()) for r in range(world)]
    return results


@pytest.mark.slow  # four processes, then two more: the matrix of process counts (make test-all)
def test_a_sharded_checkpoint_resumes_on_another_number_of_processes_in_float64(rank_results, reshard_results):
    """train.fsdp, AdamW with warmup, a checkpoint every step, 4 examples per step: stopped during step 2 on 2 gloo
    processes of 1 x 2, resumed on 4 processes of 1 x 1; and stopped during step 2 on 4, resumed on 2.
    torch.distributed.checkpoint reshards the weights and the AdamW moments on load: the per-step loss and
    grad_norm equal the uninterrupted 2-process run's within 1e-12 relative, the same on every process, and
    models/ (rank 0's, loaded by from_pretrained here) within 1e-12 of it, weight by weight."""
    from transformers import LlamaForCausalLM

    from tests.unit.equivalence.float64 import REL
    if "failure" in reshard_results:
        raise reshard_results["failure"]
    whole = _part(rank_results, "fsdp_resume")[0]["whole"]
    four, two = reshard_results["fsdp_reshard_four"], reshard_results["fsdp_reshard_two"]
    assert all(r == four[0] for r in four) and two[0] == two[1]
    assert four[0]["kept"] == [2, 4]  # step 2's checkpoint, holding the shards of 4 processes
    worst = {}
    for name, rows in (("2 -> 4", four[0]["resumed"]), ("4 -> 2", two[0]["resumed"])):
        assert len(rows) == len(whole) == 4
        worst[name] = max(abs(a[k] - b[k]) / abs(b[k]) for a, b in zip(rows, whole) for k in ("loss", "grad_norm"))
    assert all(abs(a - b["loss"]) <= REL * b["loss"] for a, b in zip(four[0]["first"], whole)), four[0]["first"]
    out = rank_results["fsdp_weights"].parent
    load = functools.partial(LlamaForCausalLM.from_pretrained, dtype=torch.float64)
    ref = load(str(out / "fsdp_resume-rank0-whole-model"))
    for name, model in (("2 -> 4", "fsdp_reshard_four-rank0-from-2-model"),
                        ("4 -> 2", "fsdp_reshard_two-rank0-from-4-model")):
        got = load(str(out / model))
        weights = max(((p - q).norm() / q.norm()).item() for p, q in zip(got.parameters(), ref.parameters()))
        assert weights <= REL, (name, weights)
        worst[name] = max(worst[name], weights)
    assert max(worst.values()) <= REL, worst
    print("fsdp resharded resume, worst relative difference of loss, grad_norm and weights: "
          + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()))


def test_bf16_autocast_sharded_is_data_parallel_and_the_same_run_to_run(rank_results):
    """train.fsdp under bf16 (accelerate's autocast, the parameters and their gradients float32, as without
    sharding; not FSDP2's own MixedPrecisionPolicy, whose bf16 reductions made grad_norm vary run to run,
    LLaMA-Factory PR #10211): 2 gloo processes x 1 x 2, 3 AdamW steps clipped at 1.0, on a float32 tiny Llama.
    Sharded twice: the same per-step loss and grad_norm and weights, to the bit. Sharded against plain data
    parallel of the same micro-batches: step 1's loss to the bit (the same bf16 forward), its grad_norm within
    1e-5 (the norm summed over shards, in another order: measured 1.2e-6); then AdamW carries that into the
    weights (it normalises each element's step, so a rounding-level difference of a small gradient moves its
    update by up to the learning rate): losses within 1e-6, grad_norm 1e-4, weights 1e-3 (measured 3.6e-7, 2.4e-5,
    9.3e-5); a wrong reduction or a missing sync moves them by 1e-2 and more."""
    ranks = _part(rank_results, "fsdp_bf16")
    for r in ranks:
        assert r["sharded"] == r["again"]  # rows, and rank 0's weights, to the bit
        assert len(r["sharded"]["rows"]) == 3 and r["sharded"]["rows"] == ranks[0]["sharded"]["rows"]
    sharded, plain = ranks[0]["sharded"], ranks[0]["data_parallel"]
    assert sharded["rows"][0]["loss"] == plain["rows"][0]["loss"]
    assert abs(sharded["rows"][0]["grad_norm"] / plain["rows"][0]["grad_norm"] - 1) <= 1e-5
    worst = {k: max(abs(a[k] / b[k] - 1) for a, b in zip(sharded["rows"], plain["rows"]))
             for k in ("loss", "grad_norm")}
    moved = max(float((torch.tensor(sharded["weights"][n]) - torch.tensor(w)).abs().max()
                      / torch.tensor(w).abs().max()) for n, w in plain["weights"].items())
    print(f"fsdp bf16 against data parallel: {worst}, weights {moved:.1e}")
    assert worst["loss"] <= 1e-6 and worst["grad_norm"] <= 1e-4 and moved <= 1e-3, (worst, moved)


def _fsdp_weights(rank_results: dict):
    return rank_results["fsdp_weights"]


def _free_port() -> int:
    """A free port (test_batches.py and the classifier's float64 proof spawn their own ranks with it)."""
    return _free_ports(1)[0]


def _spawn(worker, tmp_path, *args) -> list[dict]:
    """``worker(rank, port, out_dir, *args)`` on 2 spawned ranks; each writes ``<out_dir>/rank<r>.json``
    (test_batches.py's two-process test)."""
    import torch.multiprocessing as mp
    tmp_path.mkdir(parents=True, exist_ok=True)
    mp.spawn(worker, args=(_free_port(), str(tmp_path), *args), nprocs=2, join=True)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]


def _free_ports(n: int) -> list[int]:
    """``n`` distinct free ports (their sockets held open together while chosen)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def test_two_gloo_ranks_all_reduce_once_per_step_and_give_the_one_process_gradient(rank_results):
    ranks = _part(rank_results, "all_reduce")
    # no_sync on the first micro-batch: one all-reduce (one bucket) for the step's two micro-batches.
    assert [r["allreduce_calls"] for r in ranks] == [1, 1]
    assert [r["num_items"] for r in ranks] == [8, 8]  # 5 + 3 items, summed over the ranks
    # One process over all four micro-batches: the mean over the 8 items, and its gradient.
    model = _Linear()
    x = torch.cat([torch.tensor(b[0]) for r in (0, 1) for b in DATA[r]])
    y = torch.cat([torch.tensor(b[1]) for r in (0, 1) for b in DATA[r]])
    loss = torch.nn.functional.cross_entropy(model(x)["logits"], y, ignore_index=-100)
    loss.backward()
    expected = [p.grad.tolist() for p in model.parameters()]
    for r in ranks:
        assert r["loss"] == pytest.approx(loss.item(), rel=1e-6)
        for got, want in zip(r["grads"], expected):
            assert torch.allclose(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-7), (got, want)


def test_outside_a_launch_the_helpers_are_one_process(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    assert (distributed.world_size(), distributed.rank(), distributed.launched(), distributed.is_main()) == \
        (1, 0, False, True)
    t = torch.tensor(3)
    assert distributed.sum_over_ranks(t) is t and int(t) == 3
    assert distributed.gather_over_ranks([1.0, 2.0], "cpu") == [[1.0, 2.0]]


def test_a_launch_of_another_size_than_num_processes_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="train.num_processes is 4 but this launch has 2 processes"):
        distributed.check_world(4)
    distributed.check_world(2)


def test_null_tracker_writes_nothing():
    t = distributed.NullTracker()
    run_id = t.start_run("x", {})
    with t.guard(run_id, finish="SCHEDULED"), t.system_metrics(run_id):
        t.log_params(run_id, {"a": 1})
        t.set_tags(run_id, {"b": "c"})
        t.metric_buffer(run_id).add({"loss": 1.0}, 1)
    with pytest.raises(AttributeError):
        t.connect  # noqa: B018  (only the writing calls are no-ops)


def _failing_torchrun(rank_noted: int | None, status_before: str, tracker, monkeypatch):
    """``torch.distributed.run.run`` replaced by one whose rank 0 started ``run`` (announce_run) and whose
    processes then failed: rank 0 by a lost peer, rank ``rank_noted`` first with its own error."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    def fake_run(args):
        import os
        from pathlib import Path
        os.environ["RANK"] = "0"
        run_id = tracker.start_run("ddp", {"stage": "train"})
        distributed.announce_run(run_id, "ddp-exp")
        if status_before != "RUNNING":
            tracker.end_run(run_id, status_before)
        folder = Path(os.environ[distributed.LAUNCH_DIR_ENV])
        if rank_noted is not None:
            (folder / f"failed-{rank_noted}.json").write_text(json.dumps(
                {"rank": rank_noted, "time": 1.0, "error": "RuntimeError: rank one broke"}))
        (folder / "failed-0.json").write_text(json.dumps({"rank": 0, "time": 2.0, "error": "lost peer"}))
        failures = {r: ProcessFailure(local_rank=r, pid=100 + r, exitcode=1, error_file="") for r in (0, 1)}
        raise ChildFailedError("onegpu", failures)

    monkeypatch.setattr(torchrun, "run", fake_run)
    monkeypatch.setenv("RANK", "0")  # fake_run sets it as rank 0's: monkeypatch puts the variable back
    monkeypatch.delenv("RANK")


@pytest.mark.parametrize("status_before", ["RUNNING", "FAILED"])
def test_a_failed_rank_ends_the_run_failed_naming_the_rank(fresh_root, monkeypatch, status_before):
    from onegpu import tracking
    tracker = tracking.connect("ddp-exp")
    _failing_torchrun(1, status_before, tracker, monkeypatch)
    with pytest.raises(distributed.RankFailed, match=r"rank 1 of 2 failed \(RuntimeError: rank one broke\)"):
        distributed.launch(2, ["train"])
    from mlflow import MlflowClient
    c = MlflowClient(tracker.uri)
    (r,) = c.search_runs([tracker.experiment_id])
    assert r.info.status == "FAILED"
    assert r.data.tags["error.rank"] == "1"
    assert "rank 1 of 2 failed (RuntimeError: rank one broke)" in r.data.tags["error.message"]
    assert distributed.LAUNCH_DIR_ENV not in __import__("os").environ


def test_a_stopped_run_stays_killed_when_a_rank_fails(fresh_root, monkeypatch):
    from mlflow import MlflowClient

    from onegpu import tracking
    tracker = tracking.connect("ddp-exp")
    _failing_torchrun(None, "KILLED", tracker, monkeypatch)
    with pytest.raises(distributed.RankFailed, match="rank 0 of 2 failed"):
        distributed.launch(2, ["train"])
    (r,) = MlflowClient(tracker.uri).search_runs([tracker.experiment_id])
    assert r.info.status == "KILLED" and r.data.tags["error.rank"] == "0"


def test_processes_all_stopped_by_a_signal_are_an_interrupt_not_a_failure(fresh_root, monkeypatch):
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    def fake_run(args):
        raise ChildFailedError("onegpu", {r: ProcessFailure(local_rank=r, pid=1, exitcode=code, error_file="")
                                          for r, code in ((0, 130), (1, -15))})

    monkeypatch.setattr(torchrun, "run", fake_run)
    with pytest.raises(KeyboardInterrupt, match="every training process stopped on a signal"):
        distributed.launch(2, ["train"])


@pytest.mark.parametrize("masked", [False, True], ids=["signal", "signal-masked-by-elastics-metrics"])
def test_a_stop_signal_to_the_launcher_is_an_interrupt_with_its_number(fresh_root, monkeypatch, masked):
    """SIGTERM reaching the launcher (torch elastic's SignalException) ends the launch as a KeyboardInterrupt with
    signum 15 (the stage exits 143); also when it landed in elastic's metrics wrapper before its start time was set
    and came out as UnboundLocalError with the SignalException as its context (seen once in the suite: the launcher
    then exited 1 with elastic's traceback)."""
    import signal

    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException

    def fake_run(args):
        try:
            raise SignalException("Process 1 got signal: 15", sigval=signal.SIGTERM)
        finally:
            if masked:  # as elastic.metrics.api.prof's finally does
                raise UnboundLocalError("cannot access local variable 'start' where it is not associated with a value")

    monkeypatch.setattr(torchrun, "run", fake_run)
    with pytest.raises(KeyboardInterrupt, match="stopped by SIGTERM") as stopped:
        distributed.launch(2, ["train"])
    assert stopped.value.signum == 15


def test_processes_all_refusing_bad_input_before_any_work_add_no_line_of_the_launchers(fresh_root, monkeypatch,
                                                                                       capsys, tmp_path):
    """Every process exited 2 and noted nothing (bad input found before any work, e.g. machines that resume
    different checkpoints: each printed its one line): the launcher exits 2 and prints nothing more."""
    import yaml
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from onegpu import cli
    from onegpu.errors import AlreadySaid
    from tests import defaults

    def fake_run(args):
        raise ChildFailedError("onegpu", {r: ProcessFailure(local_rank=r, pid=1, exitcode=2, error_file="")
                                          for r in (0, 1)})

    monkeypatch.setattr(torchrun, "run", fake_run)
    with pytest.raises(AlreadySaid):
        distributed.launch(2, ["train"])
    monkeypatch.setitem(cli.COMMANDS, "train", lambda args, cfg: distributed.launch(2, ["train"]))
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump(defaults.params()))
    capsys.readouterr()
    assert cli.main(["train", "--params", str(params)]) == 2
    assert capsys.readouterr().err == ""


def _torchrun_with(failures: dict[int, tuple[int, int]], notes: dict[int, str], tracker, monkeypatch):
    """``torch.distributed.run.run`` replaced by one whose rank 0 started a run and whose processes then
    ended: ``failures`` = rank -> (exit code, seconds after the first failure), ``notes`` = rank -> the
    error that process noted itself (a SIGKILLed process notes nothing)."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    def fake_run(args):
        import os
        from pathlib import Path
        os.environ["RANK"] = "0"
        distributed.announce_run(tracker.start_run("ddp", {"stage": "train"}), "ddp-exp")
        folder = Path(os.environ[distributed.LAUNCH_DIR_ENV])
        for r, error in notes.items():
            (folder / f"failed-{r}.json").write_text(json.dumps({"rank": r, "time": 5.0 + r, "error": error}))
        out = {}
        for r, (code, after) in failures.items():
            out[r] = ProcessFailure(local_rank=r, pid=100 + r, exitcode=code, error_file="")
            out[r].timestamp = 1_000 + after
        raise ChildFailedError("onegpu", out)

    monkeypatch.setattr(torchrun, "run", fake_run)
    monkeypatch.setenv("RANK", "0")  # fake_run sets it as rank 0's: monkeypatch puts the variable back
    monkeypatch.delenv("RANK")


LOST_PEER = "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer"


@pytest.mark.parametrize("signal_name, code", [("SIGKILL", -9), ("SIGSEGV", -11)])
def test_a_rank_killed_by_a_signal_is_named_not_the_survivor(fresh_root, monkeypatch, signal_name, code):
    """Rank 1 killed outright (nothing noted); rank 0 then fails on the lost peer and notes that: the run
    names rank 1 and the signal, and for SIGKILL the out-of-memory killer."""
    from mlflow import MlflowClient

    from onegpu import tracking
    tracker = tracking.connect("ddp-exp")
    _torchrun_with({0: (1, 0), 1: (code, 0)}, {0: LOST_PEER}, tracker, monkeypatch)
    with pytest.raises(distributed.RankFailed) as e:
        distributed.launch(2, ["train"])
    message = str(e.value)
    assert message.startswith(f"training process rank 1 of 2 was killed by signal {signal_name}"), message
    assert ("out-of-memory killer" in message) == (signal_name == "SIGKILL"), message
    assert "Connection closed by peer" not in message
    (r,) = MlflowClient(tracker.uri).search_runs([tracker.experiment_id])
    assert r.info.status == "FAILED"
    assert (r.data.tags["error.rank"], r.data.tags["error.exitcode"]) == ("1", str(code))
    assert r.data.tags["error.message"] == message


def test_a_process_lost_to_another_machine_is_said_so_not_blamed(fresh_root, monkeypatch):
    """Machine 0 of 2, one process each: rank 1 on machine 1 was killed outright (nothing of it reaches machine 0),
    so rank 0 fails on the lost connection. Machine 0's launcher says that rank 0 lost a process of another machine,
    whose launcher names it, not that rank 0 failed; the run ends FAILED with rank 0's steps. (A rank of machine 1
    that raises is named by machine 0: test_data_parallel_machines.py.)"""
    from mlflow import MlflowClient

    from onegpu import tracking
    tracker = tracking.connect("ddp-exp")
    _torchrun_with({0: (1, 0)}, {0: LOST_PEER}, tracker, monkeypatch)
    machines = distributed.Machines(num_machines=2, machine_rank=0, main_process_ip="127.0.0.1", main_process_port=1)
    with pytest.raises(distributed.RankFailed) as e:
        distributed.launch(2, ["train"], machines)
    assert str(e.value) == ("training process rank 0 of 2 (machine 0) lost its connection to a process on another "
                            f"machine ({LOST_PEER}): that machine's launcher names the process and why; the other "
                            "processes were stopped")
    (r,) = MlflowClient(tracker.uri).search_runs([tracker.experiment_id])
    assert r.info.status == "FAILED" and r.data.tags["error.message"] == str(e.value)
    one_machine = distributed._elsewhere(f"failed ({LOST_PEER})", distributed.Machines())
    assert one_machine == f"failed ({LOST_PEER})"  # on one machine the killed peer is known (the test above)


def test_a_sigkill_torchrun_sent_after_its_grace_does_not_hide_the_first_error(fresh_root, monkeypatch):
    """Rank 1 raised first; rank 0, stuck, was SIGKILLed by torchrun 30 s into stopping it: rank 1's
    error is the cause."""
    from onegpu import tracking
    tracker = tracking.connect("ddp-exp")
    _torchrun_with({1: (1, 0), 0: (-9, 31)}, {1: "ValueError: bad batch"}, tracker, monkeypatch)
    with pytest.raises(distributed.RankFailed,
                       match=r"^training process rank 1 of 2 failed \(ValueError: bad batch\)"):
        distributed.launch(2, ["train"])


def test_one_machine_is_torchruns_standalone_and_two_are_its_static_rendezvous_on_machine_0():
    """accelerate's meaning of num_processes (all machines'): 4 over 2 machines = 2 per machine; machine 1's
    launcher holds ranks 2, 3 (torchrun's --node-rank, honoured by the static rendezvous only)."""
    assert distributed.torchrun_args(2) == ["--standalone", "--nproc-per-node=2"]
    two = distributed.Machines(2, 1, "10.0.0.1", None, "onegpu-abc")
    assert distributed.torchrun_args(4, two) == [
        "--nnodes=2", "--node-rank=1", "--nproc-per-node=2", "--rdzv-backend=static", "--master-addr=10.0.0.1",
        "--master-port=29500", "--rdzv-id=onegpu-abc", "--max-restarts=0"]
    from torch.distributed import run as torchrun
    args = torchrun.parse_args([*distributed.torchrun_args(4, two), "--module", "onegpu", "train"])
    assert (args.nnodes, args.node_rank, args.nproc_per_node, args.master_port) == ("2", 1, "2", 29500)


@pytest.mark.parametrize("train, problem", [
    ({"machine_rank": 2, "num_machines": 2, "main_process_ip": "h"}, "train.machine_rank: is 2 but train"),
    ({"num_machines": 2, "num_processes": 3, "main_process_ip": "h"}, "train.num_processes: is 3, not divisible"),
    ({"num_machines": 2, "num_processes": 2}, "train.main_process_ip: is required with train.num_machines: 2"),
    ({"main_process_port": 70000}, "train.main_process_port: must be a TCP port from 1 to 65535"),
    ({"main_process_ip": " "}, "train.main_process_ip: must be machine 0's address"),
    ({"machine_rank": -1}, "train.machine_rank: must be an integer >= 0"),
    ({"num_machines": 0}, "train.num_machines: must be a positive integer")])
def test_a_bad_machine_setting_is_one_line_exit_2_before_any_work(tmp_path, monkeypatch, capsys, train, problem):
    import yaml

    from onegpu import cli
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"train": train}))
    monkeypatch.chdir(tmp_path)
    assert cli.main(["train"]) == 2
    err = capsys.readouterr().err
    assert problem in err and err.count("\n") == 1, err


def test_the_machine_settings_are_out_of_the_key_and_the_checkpoint_hash():
    from onegpu.config import from_container
    from onegpu.equivalence import NOT_IN_EQUIVALENCE_KEY
    from onegpu.equivalence.key import MACHINE_KEYS, run_config_hash
    one = from_container({"train": {"num_processes": 2}})
    two = from_container({"train": {"num_processes": 2, "num_machines": 2, "machine_rank": 1,
                                    "main_process_ip": "10.0.0.1", "main_process_port": 29400}})
    assert run_config_hash(one, "f") == run_config_hash(two, "f")
    for key in MACHINE_KEYS:
        assert NOT_IN_EQUIVALENCE_KEY[key] == "where the processes run, not what they compute"


def test_the_launcher_of_machine_1_says_machine_0_writes_everything():
    two = distributed.Machines(2, 1, "10.0.0.1")
    assert distributed._launching(2, two) == (
        "1 of 2 processes (ranks 1..1) on machine 1 of 2, meeting at 10.0.0.1; machine 0 writes models/, the metrics "
        "and the MLflow run; nothing is written here")


def test_a_launch_leaves_out_torch_elastics_lines_that_onegpus_own_line_says_again(caplog):
    """While a launch runs, torch elastic's "failed (exitcode ...)", "Sending process ... closing signal" and
    "Received ... death signal" records (RankFailed's and the stop's one line say which rank failed or which signal
    stopped the launch) are dropped; its other records, and the same records outside a launch, stay."""
    import logging
    api, agent = (logging.getLogger(name) for name in distributed.ELASTIC_REPEATS)
    caplog.set_level(logging.INFO)
    with distributed._without_elastic_repeats():
        api.error("failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s", 1, 1, 42, "python")
        api.warning("Sending process %s closing signal %s", 42, "SIGTERM")
        agent.warning("Received %s death signal, shutting down workers", "SIGINT")
        api.warning("Unable to shutdown process %s via %s, forcefully exiting via %s", 42, "SIGTERM", "SIGKILL")
    api.error("failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s", 1, 1, 42, "python")
    assert [r.getMessage() for r in caplog.records] == [
        "Unable to shutdown process 42 via SIGTERM, forcefully exiting via SIGKILL",
        "failed (exitcode: 1) local_rank: 1 (pid: 42) of binary: python"]


def test_a_process_whose_peer_is_gone_says_it_in_one_line_and_notes_it(tmp_path, monkeypatch, capsys):
    """A collective's lost-peer error (gloo's closed connection) in a launched process: noted for the launcher as any
    error, then one line instead of its traceback (SystemExit 1); an error of its own is noted and re-raised as it
    is (its traceback is the one that helps)."""
    monkeypatch.setenv(distributed.LAUNCH_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    lost = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:43147. This is "
                        "typically caused by a remote worker crashing.")
    with pytest.raises(SystemExit) as stopped, distributed.failure_note():
        raise lost
    assert stopped.value.code == 1
    assert capsys.readouterr().err == (
        "train: rank 0 stopped: a peer process is gone (RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection "
        "closed by peer [127.0.0.1]:43147. This is typically caused by a remote worker crashing.); the launcher "
        "names which\n")
    assert json.loads((tmp_path / "failed-0.json").read_text())["error"].startswith("RuntimeError: [gloo")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(ValueError, match="its own"), distributed.failure_note():
        raise ValueError("its own")
    assert json.loads((tmp_path / "failed-1.json").read_text())["error"] == "ValueError: its own"
    assert capsys.readouterr().err == ""
    assert not distributed.lost_peer(ValueError("Connection closed by peer"))  # not a collective's
