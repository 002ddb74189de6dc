"""``onegpu reference`` (onegpu.stages.reference): the stage's scores are the ones training would compute before
step 1 (the model as the train stage builds it, LoRA or not), the train and evaluate stages read them instead
of scoring, and a run that asks for no precomputed reference loads nothing."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from onegpu import paths  # noqa: E402
from onegpu.config import from_container  # noqa: E402
from onegpu.stages import reference  # noqa: E402
from onegpu.training import objectives, session  # noqa: E402
from onegpu.training.objectives import precomputed  # noqa: E402
from tests.unit.equivalence import float64  # noqa: E402

OBJECTIVE = objectives.get("preference")


def project(lora: bool = False, seed: int = 42, **dpo):
    """data/processed in the cwd (7 pairs: train 4, validation 2, test 1) with the packaged tokenizer, and the
    params of a 1-layer model built from config scoring them in batches of 3 pairs."""
    from datasets import DatasetDict
    pairs = float64.preference_data(7)["train"]
    DatasetDict(train=pairs.select(range(4)), validation=pairs.select([4, 5]), test=pairs.select([6])).save_to_disk(
        str(paths.PROCESSED))
    float64.chat_tokenizer().save_pretrained(str(paths.TOKENIZER))
    paths.write_json_atomic(paths.STATS, {"labels": ["text"], "fingerprint": "test"})
    model = {"task": "preference", "name_or_path": None, "n_layer": 1, "n_embd": 32, "n_head": 2,
             **({"lora": {"r": 4, "alpha": 8.0}} if lora else {})}
    return from_container({"data": {"source": "pairs.jsonl"}, "model": model,
                           "train": {"seed": seed, "dpo": {"precompute_ref_log_probs": True, **dpo}},
                           "evaluate": {"per_device_eval_batch_size": 3}}, source="test")


def as_training_starts(cfg):
    """The model and prepared data as the train stage builds them (session.build_model, then the objective's
    prepared_data: the reference's columns)."""
    from onegpu.training import prepared
    model, tok = session.build_model(cfg, None, {"labels": ["text"]})
    return model, tok, OBJECTIVE.prepared_data(prepared.load_processed(), model, tok, cfg)


def stored(dsd, split: str) -> list[float]:
    return [x for r in dsd[split] for x in (r["ref_chosen_logps"], r["ref_rejected_logps"])]


@pytest.mark.parametrize("lora", [False, True])
def test_the_stages_scores_are_what_training_scores_before_step_1(lora, capsys, monkeypatch):
    """float32, exact: the same model (a fresh LoRA adapter adds zeros), batches and output layer. Then train
    reads them (scoring would fail) and says where they came from."""
    cfg = project(lora)
    _, _, live = as_training_starts(cfg)  # nothing stored yet: scored before step 1
    assert "scored before step 1" in capsys.readouterr().out
    result = reference.run(cfg)
    assert result["pairs"] == 7 and float(_meta()["runtime_s"]) == pytest.approx(result["runtime_s"], abs=1e-3)
    assert "scored 7 pairs (train 4, validation 2, test 1)" in capsys.readouterr().out
    monkeypatch.setattr(precomputed, "score", lambda *a: pytest.fail("scored again"))
    _, _, read = as_training_starts(cfg)
    for split in ("train", "validation"):
        assert len(stored(read, split)) == 2 * len(live[split])
        assert stored(read, split) == stored(live, split)
    assert f"read from {precomputed.FILE}" in capsys.readouterr().out


def _meta() -> dict:
    from safetensors import safe_open
    with safe_open(str(precomputed.FILE), framework="pt") as f:
        return f.metadata()


def test_scores_of_other_params_are_not_read(capsys):
    """A stored scoring under another train.seed (another model built from config): training scores itself."""
    reference.run(project())
    as_training_starts(project(seed=1))
    assert "scored for other pairs or params" in capsys.readouterr().out


def test_evaluate_sets_the_trained_model_against_the_stored_scores():
    """The test split's figures with the stored reference scores = with the reference model rebuilt (1e-6)."""
    cfg = project()
    reference.run(cfg)
    model, tok, _ = as_training_starts(cfg)
    from onegpu.training import prepared
    test = prepared.load_processed()["test"]
    read = OBJECTIVE.test_figures(model, tok, test, cfg, "cpu")[0]
    live = OBJECTIVE.test_figures(model, tok, test, from_container(
        {**cfg.to_dict(), "train": {"dpo": {"precompute_ref_log_probs": False}}}, source="test"), "cpu")[0]
    for k in ("test_loss", "test_reference_accuracy", "test_rewards/margins", "test_logps/chosen"):
        assert read[k] == pytest.approx(live[k], rel=1e-6, abs=1e-6), k
    assert read["test_pairs"] == 1


def test_a_run_without_a_precomputed_reference_loads_nothing(monkeypatch, capsys):
    monkeypatch.setattr(precomputed, "initial_model", lambda *a: pytest.fail("a model was loaded"))
    cfg = project(precompute_ref_log_probs=False)
    assert reference.run(cfg) == {}
    assert capsys.readouterr().out == ("reference: nothing to score (train.dpo.precompute_ref_log_probs is false) "
                                       "-> data/reference/unused.json\n")
    assert sorted(p.name for p in paths.REFERENCE.iterdir()) == ["unused.json"]
