"""onegpu.training.objectives.causal_lm: target tokens are the items (shifted by one); its collators."""
from __future__ import annotations

import pytest

from onegpu.training import objectives
from onegpu.training.objectives.batches import CausalLMCollator, PaddingFreeCollator

torch = pytest.importorskip("torch")
OBJ = objectives.get("causal-lm")


def test_the_items_are_the_target_tokens_after_the_first_position():
    labels = torch.tensor([[5, 6, 7, -100], [-100, -100, 8, 9]])
    assert int(OBJ.count_items(labels)) == 4  # 6, 7 of the first row; 8, 9 of the second
    assert OBJ.token_level


def test_its_collator_pads_or_flattens():
    from tests.unit.tiny import tokenizer
    assert isinstance(OBJ.collator(tokenizer()), CausalLMCollator)
    assert isinstance(OBJ.collator(tokenizer(), flattened=True), PaddingFreeCollator)


def test_its_model_columns_drop_the_class_label():
    from datasets import Dataset
    ds = Dataset.from_dict({"input_ids": [[1, 2]], "attention_mask": [[1, 1]], "label": [0], "length": [2]})
    assert OBJ.model_inputs(ds).column_names == ["input_ids", "attention_mask"]


def test_the_test_line_gives_loss_perplexity_and_rouge_where_generated():
    m = {"test_loss": 3.2396, "test_perplexity": 25.52, "test_tokens": 230}
    assert OBJ.result_line(m) == "loss 3.2396 nats/token, perplexity 25.5 on 230 test tokens"
    assert OBJ.result_line({**m, "test_rouge_l": 0.219}).endswith("230 test tokens, ROUGE-L 0.219")
