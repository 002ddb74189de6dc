"""onegpu.training.objectives.classification: a row is an item; its columns, collator and test line."""
from __future__ import annotations

import pytest

from onegpu.training import objectives

torch = pytest.importorskip("torch")
OBJ = objectives.get("sequence-classification")


def test_the_items_are_the_rows_with_a_label():
    assert int(OBJ.count_items(torch.tensor([2, -100, 0, 1]))) == 3


def test_the_loss_is_the_summed_cross_entropy_over_the_steps_rows():
    logits, labels = torch.tensor([[2.0, 0.0], [0.0, 1.0], [1.0, 1.0]]), torch.tensor([0, 1, -100])
    out = {"logits": logits}
    expected = torch.nn.functional.cross_entropy(logits[:2], labels[:2], reduction="sum") / 4
    assert float(OBJ.loss(out, labels, num_items_in_batch=4)) == pytest.approx(float(expected), rel=1e-7)


def test_its_model_columns_rename_the_label_and_drop_the_text():
    from datasets import Dataset
    ds = Dataset.from_dict({"input_ids": [[1, 2]], "attention_mask": [[1, 1]], "text": ["a b"], "label": [1]})
    assert OBJ.model_inputs(ds).column_names == ["input_ids", "attention_mask", "labels"]


def test_the_test_line_gives_accuracy_f1_and_loss():
    line = OBJ.result_line({"test_accuracy": 0.92, "test_f1_macro": 0.9, "test_loss": 1.1, "test_rows": 426})
    assert line == "accuracy 0.9200, f1_macro 0.9000, loss 1.1000 on 426 test rows"


def test_a_micro_batch_of_repeats_weighs_0():
    """pad_loss (several processes, an epoch's last step): the forward runs (the processes' collectives stay in
    step), the loss is 0 and its backward adds exactly 0 to every gradient."""
    from tests.unit import tiny
    model = tiny.tiny_bert()
    batch = {"input_ids": torch.tensor([[1, 5, 6, 2]]), "attention_mask": torch.ones(1, 4, dtype=torch.int64),
             "labels": torch.tensor([1])}
    loss = OBJ.pad_loss(model, batch)
    loss.backward()
    assert float(loss) == 0.0
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters() if p.requires_grad)
