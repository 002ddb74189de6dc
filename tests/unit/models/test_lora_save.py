"""Saving a trained model's LoRA side (onegpu.models.lora.save): the adapter and tokenizer written and
the merged model returned, or a stale adapter folder removed for a fully fine-tuned model."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from onegpu.config import from_container  # noqa: E402
from onegpu.models import lora  # noqa: E402
from tests.unit.tiny import dataset, tiny_bert, tokenizer  # noqa: E402


def _lora_bert():
    cfg = from_container({"model": {"lora": {"r": 4, "alpha": 8}}}, source="test")
    model = lora.apply(tiny_bert(), cfg.model.lora, cfg.model.task)
    with torch.no_grad():  # B starts at zero: give the adapters an update, so merging changes weights
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    return model


def _logits(model, rows: int = 6):
    from transformers import DataCollatorWithPadding

    from onegpu.training.objectives import model_inputs
    ds = model_inputs(dataset(rows)["train"])
    batch = DataCollatorWithPadding(tokenizer())([ds[i] for i in range(rows)])
    batch.pop("labels")
    model.eval()
    with torch.no_grad():
        return model(**batch).logits


def test_a_lora_model_saves_its_adapter_and_tokenizer_and_returns_the_merged_model(tmp_path):
    from peft import PeftModel
    model = _lora_bert()
    before = _logits(model)
    adapter_dir = tmp_path / "models" / "adapter"
    merged = lora.save(model, tokenizer(), adapter_dir)
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= {
        p.name for p in adapter_dir.iterdir()}
    assert not lora.is_peft(merged) and type(merged).__name__ == "BertForSequenceClassification"
    assert not any("lora" in n for n, _ in merged.named_parameters())
    assert torch.allclose(_logits(merged), before, atol=1e-5)  # the merged model computes what the adapters did
    reloaded = PeftModel.from_pretrained(tiny_bert(), str(adapter_dir))
    assert torch.allclose(_logits(reloaded), before, atol=1e-5)
    assert not list(tmp_path.glob("models/.*"))  # the atomic write left no scratch folder


def test_a_fully_fine_tuned_model_removes_a_stale_adapter_and_is_returned_as_it_is(tmp_path):
    adapter_dir = tmp_path / "adapter"
    adapter_dir.mkdir()
    (adapter_dir / "adapter_config.json").write_text("{}")
    model = tiny_bert()
    assert lora.save(model, tokenizer(), adapter_dir) is model
    assert not adapter_dir.exists()
    assert lora.save(model, tokenizer(), adapter_dir) is model  # nothing to remove: no error
