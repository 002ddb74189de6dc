"""Checkpoints of other training configurations: said, kept or pruned by one rule
(onegpu.training.lifecycle.resume.review_other_checkpoints) and the train stage's use of it."""
from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from onegpu import config
from onegpu.training.lifecycle.resume import STATE_FILE, review_other_checkpoints, tidy_other_checkpoints

REPO_PARAMS = Path(__file__).resolve().parents[4] / "params.yaml"
KEY = "k" * 16
DATA = "f" * 16


def _checkpoint(root: Path, name: str, step: int, run_id: str, complete: bool = True) -> Path:
    d = root / name / f"checkpoint-{step}"
    d.mkdir(parents=True)
    (d / "model.safetensors").write_bytes(b"x")
    if complete:
        (d / STATE_FILE).write_text(json.dumps({"step": step, "rows": [], "run_id": run_id}))
    return root / name


def _run(status: str, key: str = KEY, deleted: bool = False, params: dict | None = None, **tags):
    return SimpleNamespace(info=SimpleNamespace(status=status, lifecycle_stage="deleted" if deleted else "active"),
                           data=SimpleNamespace(tags={"equivalence_key": key, "data.fingerprint": DATA, **tags},
                                                params=params or {}))


def _setup(tmp_path):
    ours = {"train.per_device_train_batch_size": 4, "train.gradient_accumulation_steps": 4, "train.seed": 42,
            "train.logging_steps": 1}
    theirs = {"train.per_device_train_batch_size": "8", "train.gradient_accumulation_steps": "2",
              "train.seed": "42", "train.logging_steps": "10"}
    root = tmp_path / "checkpoints"
    own = _checkpoint(root, "own", 5, "own-run")
    runs = {
        "running": _run("RUNNING"),
        "resumed": _run("KILLED"),  # resumed by "successor", below
        "successor": _run("RUNNING"),
        "deleted": _run("KILLED", deleted=True),
        "finished": _run("FINISHED"),
        "split": _run("KILLED", params=theirs),
        "other-key": _run("FAILED", key="o" * 16, params={**theirs, "train.seed": "7"}),
    }
    runs["resumed"].data.tags = {"equivalence_key": KEY, "onegpu.resumed_by": "successor"}
    for name, step in (("running", 2), ("resumed", 3), ("deleted", 4), ("finished", 6), ("split", 7),
                       ("other-key", 8), ("not-in-store", 9)):
        _checkpoint(root, f"cfg-{name}", step, name)
    _checkpoint(root, "cfg-cut-off", 1, "split", complete=False)
    return root, own, ours, runs


def test_review_says_keeps_and_prunes_by_the_documented_rule(tmp_path):
    root, own, ours, runs = _setup(tmp_path)
    items = {i["folder"].name: i for i in review_other_checkpoints(own, KEY, ours, DATA, runs.get)}
    assert set(items) == {"cfg-running", "cfg-resumed", "cfg-deleted", "cfg-finished", "cfg-split", "cfg-other-key",
                          "cfg-not-in-store"}  # never its own folder, never a cut-off one
    assert {n: i["action"] for n, i in items.items()} == {
        "cfg-running": "in use", "cfg-resumed": "in use", "cfg-deleted": "prune", "cfg-finished": "prune",
        "cfg-split": "superseded", "cfg-other-key": "kept", "cfg-not-in-store": "kept"}
    split = items["cfg-split"]["message"]
    assert split.startswith("the checkpoint of stopped MLflow run split at optimizer step 7 (")
    assert ("is for another configuration (train.gradient_accumulation_steps 2 there, 4 here; "
            "train.per_device_train_batch_size 8 there, 4 here) and was not used") in split
    assert "logging_steps" not in split
    assert "train.seed 7 there, 42 here" in items["cfg-other-key"]["message"]
    assert "kept for a rerun" in items["cfg-other-key"]["message"]
    assert items["cfg-deleted"]["message"].endswith("its run is deleted in MLflow, nothing can resume it")
    assert items["cfg-running"]["message"] == ""


def test_train_stage_says_what_it_does_not_use_and_prunes_what_nothing_can_resume(tmp_path, capsys):
    root, own, _, runs = _setup(tmp_path)
    cfg = config.load(REPO_PARAMS)
    runs["split"].data.params = {k: str(v) for k, v in config.flatten(cfg.to_dict()).items()}
    runs["split"].data.params["train.per_device_train_batch_size"] = "2"
    tracker = SimpleNamespace(find_run=runs.get)  # the train stage passes its tracker's find_run

    tidy_other_checkpoints(own, KEY, config.flatten(cfg.to_dict()), DATA, tracker.find_run, announce=True)
    out = capsys.readouterr().out
    left = {p.name for p in root.iterdir()}
    assert left == {"own", "cfg-running", "cfg-resumed", "cfg-split", "cfg-other-key", "cfg-not-in-store",
                    "cfg-cut-off"}
    assert ("train: the checkpoint of stopped MLflow run split at optimizer step 7 "
            f"({root / 'cfg-split'}) is for another configuration "
            f"(train.per_device_train_batch_size 2 there, {cfg.train.per_device_train_batch_size} here) "
            "and was not used; this run trains the same (equivalence key) and removes it when it finishes") in out
    assert f"train: removed the checkpoint of MLflow run deleted at optimizer step 4 ({root / 'cfg-deleted'})" in out
    assert len(out.strip().splitlines()) == 5  # deleted, finished, split, other-key, not-in-store

    tidy_other_checkpoints(own, KEY, config.flatten(cfg.to_dict()), DATA, tracker.find_run, finished=True)
    out = capsys.readouterr().out
    assert "cfg-split" not in {p.name for p in root.iterdir()}
    assert out.strip() == (f"train: removed the checkpoint of stopped MLflow run split at optimizer step 7 "
                           f"({root / 'cfg-split'}): this run finished the same training (equivalence key {KEY})")


def test_latest_checkpoint_is_a_resume_point_with_the_state_it_was_written_with(tmp_path):
    from onegpu.training.lifecycle.resume import ResumePoint, latest_checkpoint
    _checkpoint(tmp_path, "cfg", 3, "r1")
    _checkpoint(tmp_path, "cfg", 5, "r1", complete=False)  # cut off: never resumed
    point = latest_checkpoint(tmp_path / "cfg")
    assert isinstance(point, ResumePoint)
    assert (point.step, point.run_id, point.micro_batch) == (3, "r1", None)
    assert point.path.endswith("checkpoint-3")
    full = ResumePoint.from_state("c", {"step": 7, "rows": [{"step": 1}], "breakdown": {"mem_params_bytes": 8},
                                        "events": [{"step": 2}], "run_id": "", "micro_batch": 4})
    assert (full.step, full.rows, full.breakdown, full.events, full.run_id, full.micro_batch) == (
        7, [{"step": 1}], {"mem_params_bytes": 8}, [{"step": 2}], None, 4)


def test_a_resume_point_knows_its_split_older_ones_by_their_shards(tmp_path):
    from onegpu.training.lifecycle.resume import ResumePoint
    new = ResumePoint.from_state("c", {"step": 2, "micro_batch": 2, "gradient_accumulation_steps": 4,
                                       "num_processes": 2})
    assert (new.micro_batch, new.accumulation, new.num_processes, new.sharded) == (2, 4, 2, None)
    older = ResumePoint.from_state("c", {"step": 2, "micro_batch": 2, "sharded": 4})  # before the split was kept
    assert (older.accumulation, older.num_processes) == (None, 4)
    assert older.other_split(1, 1, 2) == ""  # not recorded: nothing claimed
    assert new.other_split(2, 4, 2) == ""
    assert new.other_split(4, 1, 4) == ("; written by 2 process(es) of 2 x 4, it goes on with 4 of 4 x 1: the same "
                                        "effective batch of 16")
    sharded = ResumePoint.from_state("c", {"step": 2, "micro_batch": 2, "gradient_accumulation_steps": 4,
                                           "num_processes": 2, "sharded": 2})
    assert sharded.other_split(2, 2, 4).endswith("the same effective batch of 16, its shards redistributed on load")


def test_a_process_the_checkpoint_has_no_rng_state_of_takes_process_0s(tmp_path, monkeypatch):
    """Resumed on more processes than wrote it, process 3 restores process 0's RNG states (every process starts
    from train.seed alike); processes 0 and 1 their own."""
    import random

    import torch
    import torch.distributed as dist

    from onegpu.training.lifecycle import resume
    for rank, seed in ((0, 10), (1, 11)):
        torch.manual_seed(seed)
        random.seed(seed)
        resume._save_rng(str(tmp_path), f"-rank{rank}")
    expected = {}
    for rank, seed in ((0, 10), (1, 11)):
        torch.manual_seed(seed)
        random.seed(seed)
        expected[rank] = (torch.rand(3).tolist(), random.random())
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    for rank, own in ((1, 1), (3, 0), (0, 0)):
        monkeypatch.setattr(dist, "get_rank", lambda rank=rank: rank)
        torch.manual_seed(99)
        resume.load_rng(str(tmp_path))
        assert (torch.rand(3).tolist(), random.random()) == expected[own], rank


@pytest.mark.parametrize("backend", ["accelerate", "trainer"])
def test_a_checkpoint_resumes_with_another_split_of_its_effective_batch_in_float64(tmp_path, monkeypatch, backend):
    """Stopped after optimizer step 2 of 2 x 2 (AdamW: its moments in the checkpoint), resumed at 4 x 1: the same 4
    examples a step, so steps 3 and 4 take the uninterrupted 2 x 2 run's loss and grad_norm within 1e-12 (float64;
    only the summation order differs), on both backends' checkpoints; HF Trainer's own warning that the micro-batch
    differs from its checkpoint's is left out (the stage's resume line says so)."""
    import importlib
    import logging

    from onegpu.training.backends import base
    from tests.unit.equivalence import float64
    from tests.unit.tiny import interrupt_at_step_2, logged_by
    from tests.unit.training.objectives import test_batches as tb
    monkeypatch.chdir(tmp_path)
    module = importlib.import_module(base.REGISTRY[backend])

    def run(micro: int, accum: int, sink, **kw):
        model = tb.tiny_llama().double()
        with float64.float64_throughout(model):
            return module.train(base.TrainRequest(model, tb.tokenizer(), tb.dataset(), tb.config(
                backend, micro, accum, max_steps=4, optim="adamw_torch", eval_strategy="no"), sink, **kw))
    ref = []
    run(2, 2, lambda m, s: ref.append((m["loss"], m["grad_norm"])))
    first, resume = interrupt_at_step_2(lambda sink, **kw: run(2, 2, sink, **kw), tmp_path / "ckpt")
    assert resume is not None and resume.step == 2
    rest = []
    logging.Logger.warning_once.cache_clear()  # Trainer warns once per process and message
    with logged_by("transformers.trainer_utils") as said:
        run(4, 1, lambda m, s: rest.append((m["loss"], m["grad_norm"])), checkpoint_dir=tmp_path / "ckpt",
            resume=resume)
    assert not [m for m in said if "(from trainer_state.json)" in m], said
    assert len(ref) == 4 and len(rest) == 2
    worst = max(abs(a - b) / abs(b) for got, want in zip(rest, ref[2:]) for a, b in zip(got, want))
    assert worst <= float64.REL, (rest, ref[2:])


# -- a checkpoint is complete or not there: SIGKILL and a full disk --------------------------------------

# A backend's training with a checkpoint every step; the process kills itself with SIGKILL (as a scheduler
# does after its grace period, or the kernel's OOM killer) at the moment onegpu's state file of
# checkpoint-2 is about to be written: the backend's own files of checkpoint-2 are all on disk by then.
KILLED_MID_SAVE = """
import os, signal, sys
from onegpu import paths
from onegpu.training.backends import base
from tests.unit.training.lifecycle.test_resume import checkpointing_request
real = paths.write_json_atomic
def write(path, obj):
    if "checkpoint-2" in str(path):
        os.kill(os.getpid(), signal.SIGKILL)
    real(path, obj)
paths.write_json_atomic = write
backend, ckpt = sys.argv[1:]
import importlib
importlib.import_module(base.REGISTRY[backend]).train(checkpointing_request(backend, ckpt))
"""


def checkpointing_request(backend: str, ckpt=None, resume=None, sink=None):
    """A tiny BERT's 3-step training on ``backend`` with a checkpoint every step into ``ckpt``."""
    from onegpu.config import from_container
    from onegpu.training.backends.base import TrainRequest
    from tests.unit.tiny import dataset, tiny_bert, tokenizer
    cfg = from_container({"model": {"dropout": 0.0},
                          "train": {"backend": backend, "per_device_train_batch_size": 4,
                                    "gradient_accumulation_steps": 2, "max_steps": 3, "save_steps": 1,
                                    "learning_rate": 1e-3, "logging_steps": 100}}, source="test")
    return TrainRequest(tiny_bert(), tokenizer(), dataset(24), cfg, sink or (lambda m, s: None),
                        checkpoint_dir=ckpt, resume=resume, checkpoint_meta={"run_id": "r1"})


def _train(backend: str, request):
    import importlib

    from onegpu.training.backends import base
    return importlib.import_module(base.REGISTRY[backend]).train(request)


@pytest.mark.parametrize("backend", ["trainer", "accelerate"])
def test_a_sigkill_while_a_checkpoint_is_saved_leaves_the_previous_one_and_the_next_run_resumes_from_it(
        tmp_path, monkeypatch, backend):
    """Issue 30: HF Trainer's own rotation (save_total_limit) removed checkpoint-1 before onegpu's state
    made checkpoint-2 complete, so a SIGKILL in between left nothing to resume."""
    import signal
    import subprocess
    import sys

    from onegpu.training.lifecycle.resume import latest_checkpoint
    repo = Path(__file__).resolve().parents[4]
    ckpt = tmp_path / "ckpt"
    p = subprocess.run([sys.executable, "-c", KILLED_MID_SAVE, backend, str(ckpt)], cwd=repo, capture_output=True,
                       text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(repo)})
    assert p.returncode == -signal.SIGKILL, p.stderr[-3000:]
    kept = latest_checkpoint(ckpt)
    assert kept is not None and kept.step == 1, sorted(x.name for x in ckpt.iterdir())
    monkeypatch.chdir(tmp_path)
    ref, rest = [], []
    _train(backend, checkpointing_request(backend, sink=lambda m, s: ref.append(m["loss"])))
    _, rec = _train(backend, checkpointing_request(backend, ckpt, resume=kept,
                                                   sink=lambda m, s: rest.append(m["loss"])))
    assert [r["step"] for r in rec.rows] == [1, 2, 3]
    assert rest == pytest.approx(ref[1:], abs=1e-6)  # steps 2 and 3, as the uninterrupted run took them


@pytest.mark.parametrize("backend", ["trainer", "accelerate"])
def test_a_full_disk_while_saving_a_checkpoint_is_one_error_naming_it_and_the_previous_one_stays(
        tmp_path, monkeypatch, backend):
    import errno

    import torch

    from onegpu.errors import DiskFullError
    from onegpu.training.lifecycle.resume import latest_checkpoint
    real = torch.save

    def full(obj, f, *a, **kw):
        if "checkpoint-2" in str(f):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(obj, f, *a, **kw)
    monkeypatch.setattr(torch, "save", full)
    monkeypatch.chdir(tmp_path)
    ckpt = tmp_path / "ckpt"
    with pytest.raises(DiskFullError) as e:
        _train(backend, checkpointing_request(backend, ckpt))
    assert "no space left on the device writing ckpt/checkpoint-2 (" in str(e.value)  # relative to the root
    assert " free of " in str(e.value)
    kept = latest_checkpoint(ckpt)
    assert kept is not None and kept.step == 1


def test_a_sharded_save_cut_off_mid_way_leaves_the_previous_checkpoint_which_loads_back(tmp_path, monkeypatch):
    """train.fsdp's checkpoint (one gloo process, a model under fully_shard, AdamW): a save cut off inside
    torch.distributed.checkpoint's write (a SIGKILL's stand-in) leaves a checkpoint-2 folder without onegpu's state
    file, so the newest complete checkpoint is still step 1's; loading it puts step 1's weights back into the
    shards."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from onegpu.training.lifecycle import resume
    from onegpu.training.parallel import sharding
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4)).double()
        sharding.shard(model, "cpu", True)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        model(torch.ones(2, 4, dtype=torch.float64)).sum().backward()
        opt.step()
        rec = SimpleNamespace(rows=[{"loss": 1.0}], breakdown={}, events=[], evals=[])
        resume.save_sharded_state(tmp_path / "ck", 1, model, opt, sched, rec, {"run_id": "r1"})
        want = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}

        def killed(*args, **kwargs):
            raise KeyboardInterrupt("killed while writing the shards")
        monkeypatch.setattr(dcp, "save", killed)
        with pytest.raises(KeyboardInterrupt):
            resume.save_sharded_state(tmp_path / "ck", 2, model, opt, sched, rec, {"run_id": "r1"})
        monkeypatch.undo()
        found = resume.latest_checkpoint(tmp_path / "ck")
        assert (found.step, found.sharded, found.run_id) == (1, 1, "r1")
        cut = tmp_path / "ck" / "checkpoint-2"
        assert cut.is_dir() and not (cut / STATE_FILE).exists()
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        resume.load_sharded_state(found.path, model, opt, sched)
        assert all(torch.equal(v.full_tensor(), want[k]) for k, v in model.state_dict().items())
    finally:
        dist.destroy_process_group()
