"""onegpu.training.objectives.registry: one objective per model.task, what training assembles from it,
and that a task none declares fails in one line instead of falling into another task's branch."""
from __future__ import annotations

import pytest

from onegpu import config
from onegpu.config import from_container
from onegpu.errors import ConfigError
from onegpu.training import objectives

torch = pytest.importorskip("torch")


def test_every_task_the_params_accept_has_one_objective_and_no_other_exists():
    assert list(objectives.REGISTRY) == list(config.TASKS)
    assert all(objectives.get(t).task == t for t in config.TASKS)


def test_a_task_no_objective_has_fails_in_one_line_naming_those_that_exist():
    with pytest.raises(ConfigError) as e:
        objectives.get("dpo")
    assert str(e.value) == ("model.task: 'dpo' is not an objective onegpu trains; use one of "
                            "sequence-classification | causal-lm | preference | grpo")


def test_a_third_objective_is_asked_not_branched_on(monkeypatch):
    """A registered objective's own count and loss are what the shared helpers use (objectives.count_items,
    objectives.loss_for): none of them falls back to the classifier's for a name it does not know."""

    class Pairs(objectives.Objective):
        task = "pairs"

        def count_items(self, labels):
            return torch.tensor(labels.shape[0] // 2)

        def loss(self, outputs, labels, num_items_in_batch=None):
            return torch.tensor(0.25)
    monkeypatch.setitem(objectives.REGISTRY, "pairs", Pairs())
    labels = torch.tensor([0, 1, 2, 3, 4, 5])
    assert int(objectives.count_items(labels, "pairs")) == 3  # the classifier would count 6
    assert float(objectives.loss_for("pairs")(None, labels)) == 0.25
    assert objectives.get("pairs").token_level is False  # no traits declared: not token-level


@pytest.mark.parametrize("data, flattened, packed", [({}, False, False), ({"padding_free": True}, True, False),
                                                     ({"packing": True}, True, True)])
def test_flattened_and_packed_follow_the_data_keys_for_a_token_level_objective(data, flattened, packed):
    cfg = from_container({"model": {"task": "causal-lm", "name_or_path": None}, "data": data}, source="test")
    assert (objectives.flattened(cfg), objectives.packed(cfg)) == (flattened, packed)
    assert (objectives.flattened(from_container({}, source="test")), objectives.packed(from_container({}))) == (
        False, False)


def test_the_training_parts_are_the_objectives_rows_collator_and_loss():
    """The classifier's parts: its model columns of the train split (``length`` kept when asked), its
    padding collator and its loss; the packed causal LM's: packed rows, the padding-free collator."""
    from onegpu.data import tokenize
    from onegpu.training.objectives.batches import PaddingFreeCollator
    from tests.unit.tiny import dataset, tokenizer
    dsd = tokenize(dataset(12), tokenizer(), max_length=32)  # with prepare's `length` column
    parts = objectives.training_parts(dsd, from_container({}, source="test"), tokenizer(), with_length=True)
    assert set(parts.rows.column_names) == {"input_ids", "attention_mask", "token_type_ids", "labels", "length"}
    batch = parts.collator([{k: v for k, v in parts.rows[i].items() if k != "length"} for i in range(3)])
    assert batch["input_ids"].shape[0] == 3 and parts.loss.__self__ is objectives.get("sequence-classification")
    lm = from_container({"model": {"task": "causal-lm", "name_or_path": None}, "data": {"packing": True,
                                                                                        "max_length": 32}})
    packed = objectives.training_parts(tokenize(dataset(12), tokenizer(), max_length=32, task="causal-lm"), lm,
                                       tokenizer())
    assert isinstance(packed.collator, PaddingFreeCollator) and "seq_lengths" in packed.rows.column_names
