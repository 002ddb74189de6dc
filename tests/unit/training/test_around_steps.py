"""What both backends do around their optimizer steps (onegpu.training.around_steps): the step count, the recorder,
the one start line, checkpointing, the activation probe, the step's items over the ranks, out-of-memory recovery,
the progress and empty-cache cadences and the stop decided over the ranks. (Both backends through these, end to
end: tests/unit/training/backends/test_base.py, tests/unit/training/record/test_recorder.py.)"""
from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from onegpu.config import from_container  # noqa: E402
from onegpu.training import around_steps  # noqa: E402
from onegpu.training.around_steps import Start  # noqa: E402
from onegpu.training.parallel import distributed  # noqa: E402


def _start(world: int, **kw) -> Start:
    fields = dict(backend="accelerate", steps=12, micro=4, accum=2, world=world, rows=64, epochs=3, device="cpu",
                  mixed_precision="no", every=10)
    return Start(**{**fields, **kw})


def test_the_start_line_says_the_layout_data_device_and_precision_in_one_wording():
    assert _start(1).line() == (
        "train: 12 optimizer steps of 8 examples (4 x 2), 64 training examples in 3 epoch(s); the accelerate "
        "backend on cpu, mixed precision no; progress every 10 steps, every step goes to MLflow")
    assert _start(2, backend="trainer", mixed_precision="bf16", device=torch.device("cpu")).line() == (
        "train: 12 optimizer steps of 16 examples (4 x 2 x 2 processes), 64 training examples in 3 epoch(s); "
        "the trainer backend on cpu, mixed precision bf16; progress every 10 steps, every step goes to MLflow")


def test_announce_prints_the_start_line_and_the_compiled_optimizers_note(capsys):
    around_steps.announce(_start(1), "adamw_torch")
    assert capsys.readouterr().out.splitlines() == [_start(1).line()]
    around_steps.announce(_start(1), "adamw_torch_8bit")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == _start(1).line() and lines[1].startswith("adamw_torch_8bit: torchao compiles its optimizer")


@pytest.mark.parametrize(("train", "expected"), [
    ({"max_steps": 4}, (4, 3, 2)),  # max_steps wins: the second epoch cut short
    ({"max_steps": -1, "num_train_epochs": 2}, (6, 3, 2)),
    ({"max_steps": -1, "num_train_epochs": 1.5}, (5, 3, 2)),  # ceil(1.5 x 3) steps over 2 epochs
])
def test_schedule_counts_steps_as_trainer_does(train, expected):
    cfg = from_container({"train": {"gradient_accumulation_steps": 2, **train}}, source="test")
    assert around_steps.schedule(6, cfg) == expected  # 6 micro-batches an epoch: 3 steps of 2
    assert around_steps.schedule(5, cfg)[1] == 3  # the epoch's last step takes the one left over


def test_the_recorder_takes_the_objectives_sequences_figures_tables_and_memory_terms(monkeypatch):
    from onegpu.training import objectives
    figures = lambda: {"rewards/margins": 1.0}  # noqa: E731
    tables = {"completions.json": {"step": [1]}}
    stub = SimpleNamespace(sequences_per_item=2, step_figures=lambda model: figures,
                           memory_terms=lambda model: {"mem_reference_bytes": 7}, run_tables=lambda model: tables)
    monkeypatch.setattr(objectives, "of", lambda cfg: stub)
    rec = around_steps.new_recorder(from_container({}, source="test"), lambda m, s: None, "cpu", object())
    assert rec.counter.per_example == 2 and rec.figures is figures and rec.device == "cpu"
    assert rec.breakdown == {"mem_reference_bytes": 7} and rec.tables is tables  # the live dicts


def test_the_classifiers_recorder_has_no_figures_or_tables_of_its_own():
    rec = around_steps.new_recorder(from_container({}, source="test"), lambda m, s: None, "cpu", object())
    assert rec.figures is None and rec.breakdown == {} and rec.counter.per_example == 1 and rec.tables == {}


@pytest.mark.parametrize(("on", "by_framework", "enabled"), [(False, False, False), (True, True, False),
                                                             (True, False, True)])
def test_checkpointing_is_switched_on_once_by_whoever_does_it(monkeypatch, on, by_framework, enabled):
    from onegpu.training.memory import checkpointing
    calls = []
    monkeypatch.setattr(checkpointing, "enable", lambda model, t: calls.append((model, t)))
    t = SimpleNamespace(gradient_checkpointing=on)
    around_steps.enable_checkpointing("model", t, by_framework=by_framework)
    assert calls == ([("model", t)] if enabled else [])


def test_no_offloading_is_a_reusable_no_op_context():
    ctx = around_steps.offload_context(torch.nn.Linear(2, 2), False)
    assert isinstance(ctx, contextlib.nullcontext)
    with ctx, ctx:
        pass


def test_the_probe_is_the_first_micro_batch_moved_to_the_device_then_the_clock_starts():
    rows = [{"input_ids": [i, i + 1], "labels": i} for i in range(5)]

    def collate(features):
        return {k: torch.tensor([f[k] for f in features]) for k in features[0]}
    t = SimpleNamespace(per_device_train_batch_size=3)
    probe = around_steps.activation_probe(rows, collate, t, "sequence-classification")
    assert probe[0]["labels"].tolist() == [0, 1, 2] and callable(probe[1])
    calls = []
    rec = SimpleNamespace(probe_activations=lambda model, batch, loss_fn: calls.append(("probe", model, batch)),
                          start=lambda: calls.append(("start",)))
    around_steps.begin(rec, "model", probe, torch.device("meta"))
    assert [c[0] for c in calls] == ["probe", "start"] and calls[0][1] == "model"
    assert all(v.device.type == "meta" for v in calls[0][2].values())
    calls.clear()
    around_steps.begin(rec, None, None, None)  # no probe: only the clock
    assert calls == [("start",)]


def test_the_steps_items_are_this_ranks_own_summed_over_the_ranks(monkeypatch):
    objective = SimpleNamespace(count_batch=lambda b: b["labels"].ne(-100).sum())
    batches = [{"labels": torch.tensor([1, -100, 2])}, {"labels": torch.tensor([3, 4, 5])}]
    items = around_steps.step_items(objective, batches, torch.device("cpu"))
    assert items.dtype == torch.int64 and items.dim() == 0 and int(items) == 5
    monkeypatch.setattr(distributed, "sum_over_ranks", lambda t: t * 2)  # two ranks with the same count
    assert int(around_steps.step_items(objective, batches, "cpu")) == 10
    assert int(around_steps.step_items(objective, [], "cpu")) == 0  # a rank with only repeats: none of its own


def test_recovery_halves_the_micro_batch_and_restarts_the_objectives_step(capsys):
    model, events, restarted = torch.nn.Linear(2, 2), [], []
    model(torch.ones(1, 2)).sum().backward()
    objective = SimpleNamespace(restart_step=lambda m: restarted.append(m))
    batches = [{"input_ids": torch.zeros(4, 3)}, {"input_ids": torch.zeros(2, 3)}]  # the widest: 4 rows
    error = torch.OutOfMemoryError("boom")
    assert around_steps.recover(error, model, batches, 1, 2, 7, True, events, objective) == 2
    assert events == [{"step": 7, "old": "4 x 2", "new": "2 x 4", "micro_batch": 2}]
    assert restarted == [model] and model.weight.grad is None
    assert "out of memory at optimizer step 7" in capsys.readouterr().out
    with pytest.raises(torch.OutOfMemoryError, match="boom"):  # train.oom_retry off: the error itself
        around_steps.recover(error, model, batches, 1, 2, 7, False, events, objective)
    assert len(restarted) == 1


def test_progress_lines_every_n_steps_and_at_the_last(capsys):
    rec = SimpleNamespace(rows=[], device="cpu", evals=[])
    for step in range(1, 6):
        rec.rows.append({"step": step, "loss": 1.0, "step_time_s": 0.5, "samples_per_second": 8.0,
                         "mem_peak_bytes": 0})
        around_steps.progress(rec, step, 5, 2)
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split(" | ")[0] for ln in lines] == ["step 2/5", "step 4/5", "step 5/5"]


def test_the_cache_is_emptied_every_n_optimizer_steps_and_never_with_none(monkeypatch):
    from onegpu.measure import memory
    calls = []
    monkeypatch.setattr(memory, "empty_cache", lambda: calls.append(1))
    assert [s for s in range(1, 8) if around_steps.empty_cache(s, 3)] == [3, 6]
    assert len(calls) == 2
    assert not any(around_steps.empty_cache(s, every) for s in range(1, 8) for every in (0, None))
    assert len(calls) == 2


def test_a_stop_on_any_rank_stops_every_rank(monkeypatch):
    asked = []

    def any_rank(flag, device):
        asked.append((flag, device))
        return True  # another rank's stop
    monkeypatch.setattr(distributed, "any_rank", any_rank)
    asked_for, none = SimpleNamespace(requested=15), SimpleNamespace(requested=None)
    assert around_steps.stop_requested(asked_for, 1, "cpu") and not around_steps.stop_requested(none, 1, "cpu")
    assert not around_steps.stop_requested(None, 1, "cpu")
    assert asked == []  # one process: no collective
    assert around_steps.stop_requested(none, 2, "cpu")
    assert asked == [(False, "cpu")]  # this rank's own flag, decided over the ranks


def test_the_interruption_carries_this_ranks_signal_or_sigterm():
    assert around_steps.interruption(SimpleNamespace(requested=2), 4).signum == 2
    stopped = around_steps.interruption(SimpleNamespace(requested=None), 4)  # another rank's stop
    assert (stopped.signum, stopped.step) == (15, 4)
    assert around_steps.interruption(None, 4).signum == 15
