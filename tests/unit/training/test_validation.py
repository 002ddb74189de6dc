"""Validation during training: when it runs (HF's eval_strategy / eval_steps), that it changes no training
value (losses, grad norms, weights bit-equal with it off, dropout on), and that both backends give the
same figures, exact over the split."""
from __future__ import annotations

import math

import pytest

from onegpu import config
from onegpu.errors import ConfigError
from onegpu.training import validation
from tests.unit.tiny import dataset, tiny_bert, tokenizer

torch = pytest.importorskip("torch")


def _cfg(**train) -> config.Config:
    base = {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "max_steps": 4, "learning_rate": 1e-3}
    return config.from_container({"model": {"dropout": 0.1}, "evaluate": {"per_device_eval_batch_size": 3},
                                  "train": {**base, **train}})


@pytest.mark.parametrize("train, every", [
    ({"eval_strategy": "no"}, None),
    ({"eval_strategy": "steps", "eval_steps": 3}, 3),
    ({"eval_strategy": "steps", "eval_steps": 0.25}, 3),  # ceil(0.25 x 10): HF's share of the run
    ({"eval_strategy": "steps", "eval_steps": 0.01}, 1),
    ({"eval_strategy": "epoch"}, 4),
])
def test_the_interval_follows_hf(train, every):
    assert validation.interval(_cfg(**train), total_steps=10, steps_per_epoch=4) == every


def test_an_eval_steps_beyond_the_run_and_an_empty_split_are_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"train.eval_steps: 12 optimizer steps is more than the run's 10"):
        validation.interval(_cfg(eval_steps=12), 10, 5)
    dsd = {"validation": []}
    with pytest.raises(ConfigError, match="the validation split is empty"):
        validation.for_run(None, None, dsd, _cfg(), "cpu", 10, 5)
    assert validation.for_run(None, None, {"train": []}, _cfg(), "cpu", 10, 5) is None  # no such split: none


def test_eval_steps_must_be_steps_or_a_share_below_one():
    with pytest.raises(ConfigError, match="train.eval_steps: must be a positive integer"):
        config.from_container({"train": {"eval_steps": 2.5}})
    with pytest.raises(ConfigError, match="train.eval_strategy: must be one of no, steps, epoch"):
        config.from_container({"train": {"eval_strategy": "always"}})


def _data():
    from datasets import DatasetDict
    d = dataset(40)["train"]
    return DatasetDict(train=d.select(range(32)), validation=d.select(range(32, 39)))  # 7 rows: batches 3, 3, 1


def _train(backend: str, **train):
    """(per-step rows, eval points, final weights) of a tiny BERT trained on ``_data`` with ``backend``."""
    import importlib

    from onegpu.training.backends.base import TrainRequest
    module = importlib.import_module(f"onegpu.training.backends.{'hf_trainer' if backend == 'trainer' else backend}")
    steps, points = [], []

    def sink(m, s):
        (points if "eval_loss" in m else steps).append((s, m))
    model, _ = module.train(TrainRequest(tiny_bert(), tokenizer(), _data(), _cfg(**train), sink))
    return steps, points, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("backend", ["trainer", "accelerate"])
def test_validation_changes_no_training_value_bit_for_bit_with_dropout_on(backend):
    on_steps, points, on_weights = _train(backend, eval_strategy="steps", eval_steps=3)
    off_steps, none, off_weights = _train(backend, eval_strategy="no")
    assert none == []
    assert [s for s, _ in points] == [3, 4]  # every 3 steps, and the run's last
    assert [(s, m["loss"], m["grad_norm"]) for s, m in on_steps] == [(s, m["loss"], m["grad_norm"])
                                                                     for s, m in off_steps]
    assert all(bool((on_weights[k] == off_weights[k]).all()) for k in off_weights)
    for _, m in points:
        assert set(m) >= {"eval_loss", "eval_accuracy", "eval_f1_macro", "eval_runtime", "eval_mem_peak_bytes"}
        assert m["eval_rows"] == 7 and math.isfinite(m["eval_loss"])


def test_both_backends_give_the_same_validation_figures():
    _, a, _ = _train("trainer", eval_steps=2)
    _, b, _ = _train("accelerate", eval_steps=2)
    assert [s for s, _ in a] == [s for s, _ in b] == [2, 4]
    for (_, x), (_, y) in zip(a, b):
        assert x["eval_loss"] == pytest.approx(y["eval_loss"], rel=1e-6)
        assert (x["eval_accuracy"], x["eval_f1_macro"]) == (y["eval_accuracy"], y["eval_f1_macro"])


@pytest.mark.parametrize("losses, threshold, best, waited", [
    ([1.0, 0.8, 0.9, 0.95], 0.0, 2, 2),
    ([1.0, 0.8, 0.79, 0.78], 0.05, 4, 2),  # better, but not by more than the threshold: patience runs on
    ([1.0, 0.8, 0.79, 0.7], 0.05, 4, 0),
])
def test_the_best_point_and_the_patience_counter_follow_hf(losses, threshold, best, waited):
    evals = [{"step": i + 1, "eval_loss": x} for i, x in enumerate(losses)]
    point, n = validation.best_point(evals, "eval_loss", False, threshold)
    assert (point["step"], n) == (best, waited)
    assert validation.greater(_cfg(metric_for_best_model="eval_accuracy").train) is True
    assert validation.greater(_cfg().train) is False


def _planted(monkeypatch, losses: list[float]):
    """Validation figures planted per point (``losses`` in order); each point keeps the weights it saw."""
    from onegpu.training import objectives
    seen = {}

    def planted(model, tokenizer, dataset, cfg, device):
        seen[len(seen) + 1] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        return {"eval_loss": losses[len(seen) - 1], "eval_accuracy": 0.5, "eval_runtime": 0.0}
    monkeypatch.setattr(objectives, "validation_metrics", planted)
    return seen


@pytest.mark.parametrize("backend", ["trainer", "accelerate"])
def test_early_stopping_stops_at_the_planted_step_and_the_best_weights_are_kept(backend, monkeypatch, tmp_path):
    """eval_loss 1.0, 0.8 (best, step 2), 0.9, 0.95: with patience 2 the run stops after step 4 of 8, and
    models/ gets step 2's weights (bit-equal), not step 4's."""
    from onegpu.training import session
    seen = _planted(monkeypatch, [1.0, 0.8, 0.9, 0.95, 0.5, 0.5, 0.5, 0.5])
    import importlib

    from onegpu.training.backends.base import TrainRequest
    module = importlib.import_module(f"onegpu.training.backends.{'hf_trainer' if backend == 'trainer' else backend}")
    cfg = _cfg(max_steps=8, eval_steps=1, early_stopping_patience=2, load_best_model_at_end=True)
    steps = []
    req = TrainRequest(tiny_bert(), tokenizer(), _data(), cfg, lambda m, s: steps.append(s), checkpoint_dir=tmp_path)
    model, rec = session.validation.finish(*module.train(req))
    assert sorted(set(steps)) == [1, 2, 3, 4] and len(seen) == 4
    assert rec.stopped_early.startswith("early stopping after optimizer step 4 of 8: eval_loss has not improved")
    assert rec.best == {"step": 2, "metric": "eval_loss", "value": 0.8}
    weights = model.state_dict()
    assert all(bool((weights[k] == seen[2][k]).all()) for k in seen[2])
    assert not all(bool((weights[k] == seen[4][k]).all()) for k in seen[4])
    on_disk = torch.load(tmp_path / validation.BEST_FILE, weights_only=True)  # the best point, the breakdown's bytes
    assert rec.memory()["mem_best_model_bytes"] == sum(t.numel() * t.element_size() for t in on_disk.values()) > 0


def test_keeping_the_best_weights_on_a_cpu_copies_no_tensor(monkeypatch, tmp_path):
    """Validation._save_best writes the state dict's own tensors on a CPU (the same storage as the model's:
    no second copy of the model in memory), and counts their bytes for the breakdown."""
    model = tiny_bert()
    written = {}
    monkeypatch.setattr(torch, "save", lambda state, path: written.update(state))
    v = validation.Validation(model, tokenizer(), _data()["validation"], _cfg(load_best_model_at_end=True), "cpu",
                              1, 2, tmp_path)
    (tmp_path / (validation.BEST_FILE + ".tmp")).write_bytes(b"")  # what torch.save would have written
    v._save_best()
    own = model.state_dict()
    assert written.keys() == own.keys()
    assert all(written[k].data_ptr() == own[k].data_ptr() for k in own)
    assert v.best_bytes == sum(t.numel() * t.element_size() for t in own.values())


def test_best_model_and_early_stopping_need_validation_and_a_figure_of_the_task():
    with pytest.raises(ConfigError, match="train.load_best_model_at_end: needs validation points"):
        config.from_container({"train": {"eval_strategy": "no", "load_best_model_at_end": True}})
    with pytest.raises(ConfigError, match="train.early_stopping_patience: needs validation points"):
        config.from_container({"train": {"eval_strategy": "no", "early_stopping_patience": 3}})
    with pytest.raises(ConfigError, match="eval_perplexity is not a figure of sequence-classification"):
        config.from_container({"train": {"metric_for_best_model": "eval_perplexity"}})


def test_the_plan_refuses_an_empty_split_or_an_eval_steps_beyond_the_run_before_any_work():
    """data/stats.json's rows: 64 training rows at 4 x 2 are 8 optimizer steps (max_steps -1, one epoch)."""
    stats = {"splits": {"train": {"rows": 64}, "validation": {"rows": 7}}}
    cfg = _cfg(max_steps=-1, eval_steps=8)
    validation.check_plan(cfg, stats)  # 8 of 8: allowed
    with pytest.raises(ConfigError, match="train.eval_steps: 9 optimizer steps is more than the run's 8"):
        validation.check_plan(_cfg(max_steps=-1, eval_steps=9), stats)
    with pytest.raises(ConfigError, match="the validation split is empty"):
        validation.check_plan(cfg, {"splits": {"train": {"rows": 64}, "validation": {"rows": 0}}})
    validation.check_plan(_cfg(eval_strategy="no", eval_steps=9), {"splits": {"validation": {"rows": 0}}})


@pytest.mark.parametrize("backend", ["trainer", "accelerate"])
def test_a_resumed_run_continues_the_points_the_best_and_the_patience(backend, monkeypatch, tmp_path):
    """A stop asked for as step 2's validation point is logged (both backends check for a stop once
    the pass is over, and stop there with its point in the checkpoint), then resumed: the checkpoint
    holds the points so far, the resumed run adds the rest (no point twice, none missing), the
    patience counted over all of them stops it after step 4 as the uninterrupted run does, and the best
    (step 2, saved before the stop) is what models/ gets."""
    import importlib

    from onegpu.training.backends.base import TrainRequest
    from onegpu.training.lifecycle.interrupt import Interrupted
    from onegpu.training.lifecycle.resume import latest_checkpoint
    seen = _planted(monkeypatch, [1.0, 0.8, 0.9, 0.95, 0.5, 0.5, 0.5, 0.5])
    module = importlib.import_module(f"onegpu.training.backends.{'hf_trainer' if backend == 'trainer' else backend}")
    cfg = _cfg(max_steps=8, eval_steps=1, early_stopping_patience=2, load_best_model_at_end=True)

    class Stop:
        requested = None
    stop = Stop()

    def sink(m, s):
        if s == 2 and "eval_loss" in m:
            stop.requested = 2
    with pytest.raises(Interrupted):
        module.train(TrainRequest(tiny_bert(), tokenizer(), _data(), cfg, sink, checkpoint_dir=tmp_path, stop=stop,
                                  checkpoint_meta={"run_id": "r1"}))
    point = latest_checkpoint(tmp_path)
    assert point.step == 2
    assert [p["step"] for p in point.evals] == list(range(1, point.step + 1))
    later = []
    model, rec = validation.finish(*module.train(TrainRequest(
        tiny_bert(), tokenizer(), _data(), cfg, lambda m, s: later.append(s), checkpoint_dir=tmp_path, resume=point)))
    assert [p["step"] for p in rec.evals] == [1, 2, 3, 4] and len(seen) == 4
    assert sorted(set(later)) == list(range(point.step + 1, 5))
    assert rec.stopped_early.startswith("early stopping after optimizer step 4 of 8")
    assert rec.best == {"step": 2, "metric": "eval_loss", "value": 0.8}
    assert all(bool((model.state_dict()[k] == seen[2][k]).all()) for k in seen[2])
    # the best was kept by the stopped run: the resumed run's breakdown still counts its bytes
    assert rec.memory()["mem_best_model_bytes"] == sum(t.numel() * t.element_size() for t in seen[2].values())


def test_eval_strategy_no_may_be_written_unquoted_as_hf_users_write_it(tmp_path):
    """YAML 1.1 reads an unquoted `no` as false: params.yaml's `eval_strategy: no` and `-S
    train.eval_strategy=no` mean HF's "no", not an error."""
    (tmp_path / "params.yaml").write_text("train:\n  eval_strategy: no\n")
    assert config.load(tmp_path / "params.yaml").train.eval_strategy == "no"
    (tmp_path / "params.yaml").write_text("train:\n  eval_strategy: steps\n")
    assert config.load(tmp_path / "params.yaml", ["train.eval_strategy=no"]).train.eval_strategy == "no"
