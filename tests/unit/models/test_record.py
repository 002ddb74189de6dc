"""What MLflow records of a trained model (onegpu.models.record): the params that define it, where its files
are, and the DVC hash only where dvc.lock is train's own."""
from __future__ import annotations

from onegpu.config import from_container
from onegpu.models import record


def test_a_full_fine_tune_names_its_base_its_precision_and_its_folder(monkeypatch):
    monkeypatch.delenv("DVC_EXP_NAME", raising=False)
    cfg = from_container({"train": {"bf16": True, "learning_rate": 1e-4}})
    spec = record.logged_model(cfg, "k" * 16, "bs4x4-bf16")
    assert spec.name == "bs4x4-bf16" and spec.model_type == cfg.model.task
    assert spec.params["equivalence_key"] == "k" * 16 and spec.params["finetuning"] == "full"
    assert spec.params["precision"] == "bf16" and spec.params["learning_rate"] == "0.0001"
    assert spec.params["base_model"] == str(cfg.model.name_or_path)
    assert not any(k.startswith("lora.") for k in spec.params)
    assert spec.tags == {record.MODEL_DIR_TAG: "models/model", record.BASE_TAG: str(cfg.model.name_or_path)}


def test_a_lora_model_names_its_adapter_its_rank_and_its_base(monkeypatch):
    monkeypatch.setenv("DVC_EXP_NAME", "lora-r8")
    cfg = from_container({"model": {"lora": {"r": 8, "alpha": 16.0}}})
    spec = record.logged_model(cfg, "k" * 16, "lora-r8")
    assert (spec.params["finetuning"], spec.params["lora.r"], spec.params["lora.alpha"]) == ("lora", "8", "16.0")
    assert spec.params["precision"] == "fp32"
    assert spec.tags[record.ADAPTER_TAG] == "models/adapter" and spec.tags[record.MODEL_DIR_TAG] == "models/model"
    assert spec.tags["dvc.exp_name"] == "lora-r8"
