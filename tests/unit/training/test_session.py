"""The training session (onegpu.training.session): the plan (layout once, key, resume point, the params
and model path computed once), the training loop's interpreter settings, and the module's shape: it
trains and nothing else (no tracking import, under 250 lines)."""
from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

pytest.importorskip("torch")

from onegpu.config import Resolved, flatten, from_container  # noqa: E402
from onegpu.equivalence import equivalence_key  # noqa: E402
from onegpu.training import session  # noqa: E402
from onegpu.training.lifecycle.resume import STATE_FILE  # noqa: E402

STATS = {"fingerprint": "f" * 16, "labels": ["a", "b"]}
AUTO = {"per_device_train_batch_size": "auto", "effective_batch_size": 8, "memory_budget_gib": 1}


def _cfg(**train):
    return from_container({"train": train}, source="test")


def test_fixed_split_is_resolved_in_the_plan_and_auto_waits_for_the_finder(tmp_path, monkeypatch):
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))
    fixed = session.plan(_cfg(per_device_train_batch_size=4, gradient_accumulation_steps=2), STATS)
    assert fixed.resolved == Resolved(4, 2, 1) and fixed.budget is None and fixed.resume is None
    assert fixed.device == "cpu" and fixed.checkpoint_dir.parent == tmp_path / ".onegpu" / "checkpoints"
    auto = session.plan(_cfg(**AUTO), STATS)
    assert auto.resolved is None and auto.budget == 2**30
    # the key reads the effective batch only: the same for any split of 8
    assert auto.key == fixed.key == equivalence_key(fixed.cfg, Resolved(8, 1, 1), STATS["fingerprint"])


def test_auto_resumes_with_the_split_its_checkpoint_was_written_with(tmp_path, monkeypatch):
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))
    first = session.plan(_cfg(**AUTO), STATS)
    d = first.checkpoint_dir / "checkpoint-3"
    d.mkdir(parents=True)
    (d / STATE_FILE).write_text(json.dumps({"step": 3, "rows": [], "run_id": "r1", "micro_batch": 2}))
    again = session.plan(_cfg(**AUTO), STATS)
    assert (again.resume.step, again.resume.run_id) == (3, "r1")
    assert again.resolved == Resolved(2, 4, 1)


def test_a_checkpoint_resumes_on_any_split_of_its_effective_batch_and_only_in_its_layout(tmp_path, monkeypatch):
    """The checkpoint folder is named by the effective batch, not its split: 4 processes of 1 x 1 find the one 2
    processes of 2 x 1 wrote, sharded (shards reshard on load) or not (whole weights), and so does 1 process of 2 x
    2; another effective batch does not. train.fsdp is outside the name: a sharded run finds a data-parallel run's
    checkpoint of the same training and the other way round, and each refuses the other's layout in one line before
    any work, with the way out."""
    from onegpu.errors import ConfigError
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))
    run = {"backend": "accelerate", "eval_strategy": "no", "oom_retry": False}
    two, four = (_cfg(**run, num_processes=n, per_device_train_batch_size=4 // n, fsdp={"enabled": True})
                 for n in (2, 4))
    plain_two, plain_four = (_cfg(**run, num_processes=n, per_device_train_batch_size=4 // n) for n in (2, 4))
    one = _cfg(**run, per_device_train_batch_size=2, gradient_accumulation_steps=2)
    other = _cfg(**run, num_processes=4, per_device_train_batch_size=2, fsdp={"enabled": True})
    d = session.plan(two, STATS).checkpoint_dir / "checkpoint-3"
    d.mkdir(parents=True)
    state = {"step": 3, "rows": [], "run_id": "r1", "micro_batch": 2, "gradient_accumulation_steps": 1,
             "num_processes": 2, "sharded": 2}
    (d / STATE_FILE).write_text(json.dumps(state))
    resumed = session.plan(four, STATS).resume
    assert (resumed.step, resumed.sharded, resumed.num_processes, resumed.micro_batch) == (3, 2, 2, 2)
    assert resumed.other_split(1, 1, 4) == ("; written by 2 process(es) of 2 x 1, it goes on with 4 of 1 x 1: the "
                                            "same effective batch of 4, its shards redistributed on load")
    assert session.plan(two, STATS).resume.other_split(2, 1, 2) == ""
    assert session.plan(other, STATS).resume is None  # effective batch 8: another training
    for plain in (plain_two, plain_four, one):
        with pytest.raises(ConfigError, match=r"a sharded checkpoint of this training exists .*checkpoint-3\); "
                                              r"resume it with train.fsdp.enabled: true"):
            session.plan(plain, STATS)
    (d / STATE_FILE).write_text(json.dumps({k: v for k, v in state.items() if k != "sharded"}))  # whole weights
    assert [session.plan(c, STATS).resume.step for c in (plain_two, plain_four, one)] == [3, 3, 3]
    with pytest.raises(ConfigError, match=r"train.fsdp.enabled: a checkpoint of this training with whole weights "
                                          r"exists .*checkpoint-3\), and a sharded run resumes only sharded "
                                          r"checkpoints; resume it with train.fsdp.enabled: false"):
        session.plan(four, STATS)


def test_a_combination_the_machine_cannot_run_stops_the_plan_before_the_data_is_read(tmp_path, monkeypatch):
    from onegpu.config import DeviceFacts
    from onegpu.errors import ConfigError
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))  # no data/stats.json here: a DataError if it got that far
    with pytest.raises(ConfigError, match="train.fp16: fp16 mixed precision needs a CUDA GPU"):
        session.plan(_cfg(fp16=True), facts=DeviceFacts())
    assert session.plan(_cfg(tf32=True), STATS, facts=DeviceFacts()).device == "cpu"  # TF32: a no-op on CPU
    gpu = DeviceFacts(cuda=True, gpus=1, name="NVIDIA H200", bf16=True, tf32=True)
    assert session.plan(_cfg(), STATS, facts=gpu).device == "cuda:0"


def test_the_training_loop_runs_with_cpythons_collector_after_the_commands_start_up(tmp_path, monkeypatch,
                                                                                   collector):
    """`onegpu train` starts with onegpu.interpreter's start-up threshold; the backend's loop (the measured
    steps) runs with CPython's default thresholds again, the start-up objects frozen."""
    import gc
    import types

    from onegpu import interpreter
    from onegpu.training.backends import base
    from onegpu.training.record.recorder import StepRecorder
    seen = []
    monkeypatch.setattr(base, "get", lambda name: types.SimpleNamespace(
        train=lambda request: seen.append((gc.get_threshold(), gc.get_freeze_count() > 0))
        or (None, StepRecorder(lambda m, s: None, "cpu", None))))
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))
    plan = session.plan(_cfg(per_device_train_batch_size=4, gradient_accumulation_steps=2), STATS)
    interpreter.start()
    session.train(plan, None, None, None, sink=lambda m, s: None, checkpoints=False)
    assert seen == [(interpreter.DEFAULT_THRESHOLD, True)]




def test_the_plan_carries_the_flattened_params_and_the_model_path_computed_once(tmp_path, monkeypatch):
    """plan() flattens the config and resolves model.name_or_path once; the tracked run logs
    ``plan.params`` and builds from ``plan.model_path`` instead of computing them again."""
    from onegpu.models import loader
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))
    calls = []
    real = loader.resolve_model_path
    monkeypatch.setattr(loader, "resolve_model_path", lambda name: calls.append(name) or real(name))
    cfg = _cfg(per_device_train_batch_size=4, gradient_accumulation_steps=2)
    plan = session.plan(cfg, STATS)
    assert calls == [cfg.model.name_or_path] and plan.model_path == real(cfg.model.name_or_path)
    assert plan.params == flatten(cfg.to_dict()) and plan.params["train.per_device_train_batch_size"] == 4


def test_build_model_runs_both_checkpointing_checks_through_one_function(monkeypatch):
    from onegpu.training.memory import checkpointing
    seen = []
    monkeypatch.setattr(checkpointing, "check", lambda model, train: seen.append(type(model).__name__))
    from tests.unit.tiny import tokenizer
    cfg = from_container({"model": {"task": "causal-lm", "name_or_path": None, "n_layer": 1, "n_embd": 32,
                                    "n_head": 2}, "train": {"gradient_checkpointing": True}}, source="test")
    model, _ = session.build_model(cfg, None, {}, tokenizer())
    assert seen == ["GPT2LMHeadModel"] and model.config.n_layer == 1


def _imported_modules(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            out |= {node.module or ""} | {f"{node.module}.{a.name}" for a in node.names}
    return out


def test_the_session_only_trains_it_imports_no_tracking_module_and_is_short():
    """Issue 31: the MLflow run's life is tracked_run's; session.py imports no onegpu.tracking module (not
    even inside a function) nor the modules that log into a run, and stays under 250 lines."""
    path = Path(session.__file__)
    names = _imported_modules(path)
    assert not {n for n in names if n == "onegpu.tracking" or n.startswith("onegpu.tracking.")}, names
    assert "mlflow" not in {n.split(".")[0] for n in names}
    assert not names & {"onegpu.training.tracked_run", "onegpu.training.record.run_tags",
                        "onegpu.training.record.closing_record"}
    assert len(path.read_text().splitlines()) < 250
