"""onegpu.training.objectives.precomputed: the key of stored reference scores (the pairs and the params that decide
them, not beta, the optimizer or LoRA), their round trip, the refusals of stored scores that are not these pairs'."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

torch = pytest.importorskip("torch")

from onegpu.config import from_container  # noqa: E402
from onegpu.training.objectives import precomputed  # noqa: E402

ROWS = {"prompt_ids": [[5, 6, 7], [14]], "chosen_ids": [[8, 9], [15, 16]], "rejected_ids": [[10], [18, 19]]}


def cfg(**train):
    return from_container({"data": {"source": "pairs.jsonl"}, "model": {"task": "preference", "name_or_path": None},
                           "train": {"dpo": {"precompute_ref_log_probs": True}, **train}}, source="test")


def test_the_stages_params_are_what_decides_the_scores():
    """DVC re-runs the reference stage when one of its params changes; the train stage accepts stored scores
    when the same params (and pairs) give the same key: the two lists are one."""
    stages = yaml.safe_load((Path(__file__).parents[4] / "dvc.yaml").read_text())["stages"]
    assert stages["reference"]["params"] == list(precomputed.PARAMS)
    assert "data/reference" in stages["train"]["deps"] and "data/reference" in stages["evaluate"]["deps"]


def test_the_key_follows_the_pairs_and_the_scoring_params_only():
    base = precomputed.key(cfg(), ROWS)
    assert precomputed.key(cfg(), {**ROWS, "rejected_ids": [[10], [18, 20]]}) != base  # one token
    assert precomputed.key(cfg(seed=7), ROWS) != base
    assert precomputed.key(cfg(fused_lm_head=False), ROWS) != base
    same = [cfg(learning_rate=1e-3), cfg(dpo={"precompute_ref_log_probs": True, "beta": 0.5}),
            cfg(per_device_train_batch_size=2, gradient_accumulation_steps=4)]
    assert {precomputed.key(c, ROWS) for c in same} == {base}


def test_stored_scores_come_back_exactly_for_their_pairs_and_not_for_others():
    c = cfg()
    assert precomputed.load("train", ROWS, c)[0] is None  # nothing stored yet
    scores = {"train": [-1.25, -3.0000000000000004, -0.1, -7.5], "test": [-2.0, -2.5]}
    precomputed.save(scores, {"train": precomputed.key(c, ROWS), "test": "other"}, 1.5, "cpu")
    logps, whence = precomputed.load("train", ROWS, c)
    assert logps == scores["train"] and "1.5 s on cpu" in whence  # float64: bit for bit
    assert precomputed.load("test", ROWS, c)[0] is None
    assert precomputed.load("train", ROWS, cfg(seed=3)) == (None, f"{precomputed.FILE} was scored for other pairs "
                                                                  "or params (the reference stage re-runs: dvc repro)")
    assert precomputed.load("validation", ROWS, c)[0] is None  # a split never scored


def test_nothing_to_score_is_one_note_whatever_else_the_params_say():
    for c in (from_container({"train": {"learning_rate": 1e-3}}, source="test"),
              from_container({"train": {"learning_rate": 5e-3, "seed": 3}}, source="test")):
        assert not precomputed.wanted(c)
        precomputed.save_unused(c)
        assert [p.name for p in precomputed.UNUSED.parent.iterdir()] == ["unused.json"]
        assert json.loads(precomputed.UNUSED.read_text()) == {
            "scored": False, "why": "model.task sequence-classification has no reference model"}
    precomputed.save({"train": [0.0, 0.0]}, {}, 0.0, "cpu")
    precomputed.save_unused(cfg(dpo={"precompute_ref_log_probs": False}))  # replaces the scores: one output
    assert [p.name for p in precomputed.UNUSED.parent.iterdir()] == ["unused.json"]
