"""onegpu.evaluation: what the evaluate stage measures (the same figures HF Trainer's predict gave, now
from a plain batched loop), which metrics each kind of data gets, and under which interpreter settings."""
from __future__ import annotations

import ast
import functools
import gc
import math
import types
import warnings
from pathlib import Path

import pytest

from onegpu import evaluation, interpreter
from onegpu.config import from_container

GROUPS = ("market shares bank rates growth", "team final match crowd won", "film reviews opened sang new")


def test_the_evaluation_loop_runs_with_cpythons_collector_after_the_commands_start_up(monkeypatch, collector):
    """`onegpu evaluate` starts with onegpu.interpreter's start-up threshold; the measured loop (here the
    classifier's) runs with CPython's default thresholds, the start-up objects frozen, as training's does."""
    from onegpu.training.objectives import heldout
    seen = []
    monkeypatch.setattr(heldout, "classifier_metrics", lambda *a: seen.append(
        (gc.get_threshold(), gc.get_freeze_count() > 0)) or ({}, [], []))
    cfg = from_container({}, source="test")
    interpreter.start()
    evaluation.metrics(None, None, types.SimpleNamespace(column_names=["text", "label"]), cfg, "cpu")
    assert seen == [(interpreter.DEFAULT_THRESHOLD, True)]


def test_each_kind_of_data_gets_its_metrics_from_its_objective(monkeypatch):
    """No branch on model.task: the objective gives the test figures; instruction data (a token-level
    objective's rows with a `reference` column) adds generation."""
    from onegpu.training.objectives import heldout
    calls = []
    monkeypatch.setattr(heldout, "classifier_metrics",
                        lambda *a: calls.append("classifier") or ({"c": 1}, [0], [1]))
    monkeypatch.setattr(heldout, "causal_lm_metrics", lambda *a: calls.append("causal") or {"l": 1})
    monkeypatch.setattr(evaluation, "sft_metrics", lambda *a: calls.append("sft") or ({"s": 1}, {"generation": []}))
    text = types.SimpleNamespace(column_names=["input_ids", "label"])
    instructions = types.SimpleNamespace(column_names=["input_ids", "label", "reference", "prompt_length"])
    cls = from_container({}, source="test")
    lm = from_container({"model": {"task": "causal-lm", "name_or_path": None}}, source="test")
    assert evaluation.metrics(None, None, text, cls, "cpu") == ({"c": 1}, None, [0], [1])
    assert evaluation.metrics(None, None, text, lm, "cpu") == ({"l": 1}, None, [], [])
    assert evaluation.metrics(None, None, instructions, lm, "cpu") == ({"s": 1}, {"generation": []}, [], [])
    assert calls == ["classifier", "causal", "sft"]


def test_evaluation_imports_no_hf_trainer():
    """Issue 31: only the trainer backend imports HF Trainer; evaluation predicts with its own loop."""
    names = set()
    for node in ast.walk(ast.parse(Path(evaluation.__file__).read_text())):
        if isinstance(node, ast.ImportFrom):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
    assert not names & {"Trainer", "TrainingArguments", "transformers.Trainer"}


@functools.cache
def _trained():
    """A tiny BERT trained 40 steps on 30 rows whose label follows their words, so it predicts more than
    one class (an untrained one predicts the same class for every row); the rows tokenized as prepare does."""
    from datasets import ClassLabel, Dataset, DatasetDict

    from onegpu.data import tokenize
    from onegpu.training.backends import accelerate
    from onegpu.training.backends.base import TrainRequest
    from tests.unit.tiny import tiny_bert, tokenizer
    texts = [" ".join((GROUPS[i % 3].split() * 6)[i % 5: i % 5 + 2 + (7 * i) % 20]) for i in range(30)]
    labels = [["business", "sport", "entertainment"][i % 3] for i in range(30)]
    ds = Dataset.from_dict({"text": texts, "label": labels}).cast_column(
        "label", ClassLabel(names=["business", "entertainment", "sport"]))
    dsd = tokenize(DatasetDict(train=ds), tokenizer(), max_length=32)
    cfg = from_container({"model": {"dropout": 0.0}, "train": {
        "backend": "accelerate", "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1,
        "max_steps": 40, "learning_rate": 3e-3, "seed": 7, "logging_steps": 100}}, source="test")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, _ = accelerate.train(TrainRequest(tiny_bert(), tokenizer(), dsd, cfg, sink=lambda m, s: None))
    return model, dsd["train"]


@pytest.mark.parametrize(("batch", "trainer_loss"), [(4, 0.6658152937889099), (7, 0.6658154129981995)])
def test_classifier_metrics_are_the_ones_hf_trainers_predict_gave(batch, trainer_loss):
    """The values HF Trainer's predict gave on this model and split (measured on the code before issue 31,
    batches of 4 and of 7, the last one short): the same loss within float32 rounding (Trainer averaged
    float32 batch means, the loop sums per example in float64), the same predictions, accuracy and F1."""
    pytest.importorskip("torch")
    from tests.unit.tiny import tokenizer
    model, split = _trained()
    cfg = from_container({"evaluate": {"per_device_eval_batch_size": batch}}, source="test")
    metrics, gold, pred = evaluation.classifier_metrics(model, tokenizer(), split, cfg, "cpu")
    assert metrics["test_loss"] == pytest.approx(trainer_loss, abs=1e-6)
    assert gold == [0, 2, 1] * 10 and pred == [0, 2, 0] * 10  # as Trainer's predictions were
    assert metrics["test_accuracy"] == 2 / 3 and metrics["test_f1_macro"] == pytest.approx(5 / 9, abs=1e-12)
    assert metrics["test_rows"] == 30 and metrics["test_runtime"] > 0
    assert metrics["test_samples_per_second"] == pytest.approx(30 / metrics["test_runtime"])


def test_the_classifier_loss_is_the_mean_over_examples_of_each_rows_own_cross_entropy():
    """Exact over the split: one row at a time, unpadded, gives the same mean loss and the same logits."""
    torch = pytest.importorskip("torch")
    from tests.unit.tiny import tokenizer
    model, split = _trained()
    out = evaluation.predict(model, tokenizer(), split, from_container({}, source="test"), "cpu")
    assert out.logits.shape == (30, 3) and out.logits.dtype == torch.float32 and out.labels.tolist() == split["label"]
    losses = []
    with torch.no_grad():
        for i, row in enumerate(split):
            logits = model(input_ids=torch.tensor([row["input_ids"]])).logits[0]
            assert torch.allclose(logits, out.logits[i], atol=1e-5)
            losses.append(float(torch.nn.functional.cross_entropy(logits, torch.tensor(row["label"]))))
    assert out.loss == pytest.approx(sum(losses) / len(losses), abs=1e-6)


def test_causal_lm_metrics_are_the_token_mean_loss_and_its_perplexity():
    """Every target token counts once, whatever the batching: batches of 3 give the loss of one row at a
    time, summed over the rows' tokens (position t predicts token t+1)."""
    torch = pytest.importorskip("torch")
    from transformers import GPT2Config, GPT2LMHeadModel

    from onegpu.data import tokenize
    from tests.unit.tiny import dataset, tokenizer
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=tokenizer().vocab_size, n_positions=64, n_embd=32, n_layer=1,
                                       n_head=2, pad_token_id=tokenizer().pad_token_id))
    split = tokenize(dataset(10), tokenizer(), max_length=32, task="causal-lm")["train"]
    cfg = from_container({"evaluate": {"per_device_eval_batch_size": 3}}, source="test")
    m = evaluation.causal_lm_metrics(model, tokenizer(), split, cfg, "cpu")
    total, tokens, hits, rows = 0.0, 0, 0, []
    with torch.no_grad():
        for ids, types_ in zip(split["input_ids"], split["token_type_ids"]):  # the collator passes both
            logits = model(input_ids=torch.tensor([ids]), token_type_ids=torch.tensor([types_])).logits[0, :-1]
            row = float(torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]), reduction="sum"))
            total, tokens, rows = total + row, tokens + len(ids) - 1, rows + [(row, len(ids) - 1)]
            hits += int(logits.argmax(-1).eq(torch.tensor(ids[1:])).sum())
    assert m["test_tokens"] == tokens and m["test_rows"] == 10
    assert m["test_loss"] == pytest.approx(total / tokens, abs=1e-5)
    assert m["test_perplexity"] == pytest.approx(math.exp(m["test_loss"]))
    assert m["test_mean_token_accuracy"] == hits / tokens
    # HF's evaluation_loop: each batch's mean token loss, repeated by the batch's rows, then the mean; on
    # these batches of 3, 3, 3 and 1 rows of unequal token counts that is another figure.
    batches = [rows[i:i + 3] for i in range(0, 10, 3)]
    hf = sum(len(b) * sum(x for x, _ in b) / sum(n for _, n in b) for b in batches) / 10
    # Measured 7.3e-4 apart (7e-5 relative: an untrained model's token losses are nearly equal), 70 times the
    # 1e-5 to which the exact figure is checked above.
    assert abs(hf - m["test_loss"]) > 1e-4, (hf, m["test_loss"])


def test_a_failed_or_stopped_evaluation_says_so_and_that_the_pipeline_reruns_evaluate_only():
    note = evaluation.failure_note(ValueError("test split has 0 rows\nTraceback..."))
    assert note.startswith("**Evaluation failed**: `ValueError: test split has 0 rows` (FAILED; tag `error.message`).")
    assert note.endswith("`dvc repro` (or the same `dvc exp run`) runs the evaluation again, not the training.")
    assert evaluation.failure_note(KeyboardInterrupt()).startswith("**Evaluation stopped** (interrupted; KILLED).")


@pytest.mark.parametrize("gold, pred", [
    ([0, 1, 2, 0, 1, 2], [0, 2, 1, 0, 0, 2]),
    ([0, 0, 0, 1], [0, 0, 0, 0]),          # a label never predicted: its F1 is 0
    ([0, 0, 1, 1], [2, 2, 1, 1]),          # a label predicted that is in no gold row counts too
    ([3, 3, 3], [3, 3, 3]),
])
def test_macro_f1_is_scikit_learns(gold, pred):
    import warnings

    from sklearn.metrics import f1_score

    from onegpu.training.objectives import heldout
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # scikit-learn warns of labels without a prediction
        assert heldout.f1_macro(gold, pred) == pytest.approx(f1_score(gold, pred, average="macro"), abs=1e-15)


@pytest.mark.parametrize("rows, world, shares", [(7, 2, [3, 4]), (7, 3, [2, 2, 3]), (1, 2, [0, 1]), (8, 1, [8])])
def test_each_process_reads_its_own_rows_of_a_held_out_split_once(monkeypatch, rows, world, shares):
    """heldout.shard: contiguous shares over the processes, every row once (none padded in twice)."""
    from datasets import Dataset

    from onegpu.training.objectives import heldout
    split, seen = Dataset.from_dict({"i": list(range(rows))}), []
    import torch.distributed as dist
    monkeypatch.setattr(dist, "is_initialized", lambda: True)  # a process group of `world`, as rank `rank`
    monkeypatch.setattr(dist, "get_world_size", lambda: world)
    for rank in range(world):
        monkeypatch.setattr(dist, "get_rank", lambda rank=rank: rank)
        seen.append(list(heldout.shard(split)["i"]))
    assert [len(s) for s in seen] == shares
    assert sum(seen, []) == list(range(rows))


def _whole_and_fused(model, split, tokenizer, batch: int) -> tuple[dict, dict]:
    """The held-out figures of ``model`` over ``split`` with the whole logits, then under the fused LM head
    with the output layer's own forward made to fail (so the whole logits cannot have been built)."""
    from onegpu.training.objectives import lm_head
    cfg = from_container({"evaluate": {"per_device_eval_batch_size": batch}}, source="test")
    whole = evaluation.causal_lm_metrics(model, tokenizer, split, cfg, "cpu")
    lm_head.attach(model)

    def whole_logits(*a, **kw):
        raise AssertionError("the fused LM head's figures built the whole logits")
    model.get_output_embeddings().forward = whole_logits
    return whole, evaluation.causal_lm_metrics(model, tokenizer, split, cfg, "cpu")


def test_under_the_fused_lm_head_the_held_out_figures_are_the_whole_logits_in_float64():
    """train.fused_lm_head: validation and test figures come from the targets' logits in tiles (no whole
    logits), and in float64 they are the whole logits' figures (loss within 1e-12, the same hits)."""
    torch = pytest.importorskip("torch")
    from transformers import GPT2Config, GPT2LMHeadModel

    from onegpu.data import tokenize
    from tests.unit.tiny import dataset, tokenizer
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=tokenizer().vocab_size, n_positions=64, n_embd=32, n_layer=1,
                                       n_head=2, pad_token_id=tokenizer().pad_token_id)).double()
    split = tokenize(dataset(10), tokenizer(), max_length=32, task="causal-lm")["train"]
    whole, fused = _whole_and_fused(model, split, tokenizer(), 3)
    assert fused["test_tokens"] == whole["test_tokens"] > 0
    assert fused["test_loss"] == pytest.approx(whole["test_loss"], rel=1e-12)
    assert fused["test_mean_token_accuracy"] == whole["test_mean_token_accuracy"]


@pytest.mark.slow
def test_on_the_packaged_chat_model_the_fused_heads_validation_figures_are_the_whole_logits_in_float64():
    """The packaged SmolLM2-135M-Instruct in float64 (its norms too), 8 answers of 1..9 words in batches of
    3, 3 and 2 (completion-only targets): the fused head's loss within 1e-12 of the whole logits', the same
    token accuracy."""
    torch = pytest.importorskip("torch")
    from onegpu.training import objectives
    from tests.unit.equivalence import float64 as f64
    model = f64.packaged_chat_model().to(torch.float64)
    f64.float64_norms(model)
    split = f64.instruction_data("answers", 8)["train"]
    whole, fused = _whole_and_fused(model, split, f64.chat_tokenizer(), 3)
    assert fused["test_tokens"] == whole["test_tokens"] == sum(
        sum(t != -100 for t in r["labels"][1:]) for r in objectives.model_inputs(split, "causal-lm"))
    assert fused["test_loss"] == pytest.approx(whole["test_loss"], rel=1e-12)
    assert fused["test_mean_token_accuracy"] == whole["test_mean_token_accuracy"]


def test_the_confusion_figure_writes_scikit_learns_confusion_matrix_in_its_cells():
    """Rows actual, columns predicted, each cell's count as scikit-learn's ``confusion_matrix`` gives it
    (a class never predicted and one never present included), with the label names on both axes."""
    from sklearn.metrics import confusion_matrix
    gold, pred, names = [0, 0, 1, 2, 2, 2, 1, 0], [0, 1, 1, 2, 0, 2, 1, 0], ["business", "sport", "tech", "other"]
    fig = evaluation.confusion_figure(gold, pred, names)
    ax = fig.axes[0]
    cells = {(round(t.get_position()[1]), round(t.get_position()[0])): int(t.get_text()) for t in ax.texts}
    expected = confusion_matrix(gold, pred, labels=range(len(names)))
    assert cells == {(i, j): int(expected[i, j]) for i in range(4) for j in range(4)}
    assert [t.get_text() for t in ax.get_xticklabels()] == names == [t.get_text() for t in ax.get_yticklabels()]
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("Predicted label", "True label")
