"""Checkpoints of other training configurations: said, kept or pruned by one rule
(onegpu.training.resume.review_other_checkpoints) and the train stage's use of it."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from onegpu import config
from onegpu.training.resume import STATE_FILE, review_other_checkpoints, tidy_other_checkpoints

REPO_PARAMS = Path(__file__).resolve().parents[3] / "params.yaml"
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
    from onegpu.training.resume import ResumePoint, latest_checkpoint
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
