"""A probe worker's data (onegpu.tradeoffs.worker): rows that agree on the params prepare reads share one
prepared copy; a row that changes any of them gets its own."""
from __future__ import annotations

import pytest

from onegpu.config import load
from onegpu.tradeoffs import worker
from tests import defaults


@pytest.fixture
def params(tmp_path):
    return str(defaults.write_params(tmp_path))


def test_training_knobs_share_the_prepared_data(params):
    base = worker.prepare_key(load(params))
    for knob in ("train.per_device_train_batch_size=16", "train.bf16=true", "train.max_steps=6",
                 "model.lora.r=8", "model.attn_implementation=eager", "train.cpu_allocator=system"):
        assert worker.prepare_key(load(params, [knob])) == base, knob


@pytest.mark.parametrize("base, knob", [([], "data.max_length=32"), ([], "data.seed=1"), ([], "model.task=causal-lm"),
                                        ([], "model.vocab_size=1024"),
                                        ([], "model.name_or_path=packaged:SmolLM2-135M-Instruct"),
                                        (["model.task=causal-lm"], "data.padding_free=true"),
                                        (["model.task=causal-lm"], "data.packing=true")])
def test_a_param_prepare_reads_gets_its_own_data(params, base, knob):
    assert worker.prepare_key(load(params, [*base, knob])) != worker.prepare_key(load(params, base))


def test_the_data_is_prepared_once_per_key(params, monkeypatch):
    calls = []
    monkeypatch.setattr("onegpu.data.check_input", lambda cfg: "text")
    monkeypatch.setattr("onegpu.data.pipeline.prepare",
                        lambda cfg, fmt, make: calls.append(cfg.data.max_length) or ("dsd", "tok", {}, None))
    cache: dict = {}
    for overrides in ([], ["train.bf16=true"], ["data.max_length=32"], []):
        assert worker.prepared(load(params, overrides), cache) == ("dsd", "tok", {})
    assert calls == [64, 32]


def test_getting_ready_prepares_the_rows_data_and_opens_the_store(params, tmp_path, monkeypatch):
    """Issue 64: what a worker's first row paid beyond its training (the data, MLflow's store) is paid
    before the rows (Pool.ready), so the row that follows prepares nothing."""
    calls, opened = [], []
    monkeypatch.setattr("onegpu.data.check_input", lambda cfg: "text")
    monkeypatch.setattr("onegpu.data.pipeline.prepare",
                        lambda cfg, fmt, make: calls.append(cfg.data.max_length) or ("dsd", "tok", {}, None))
    monkeypatch.setattr("onegpu.tracking.connect", opened.append)
    cache: dict = {}
    worker.get_ready({"params": params, "overrides": ["train.max_steps=6"]}, cache)
    assert calls == [64] and opened == [load(params).tracking.experiment_name]
    assert worker.prepared(load(params, ["train.bf16=true"]), cache) == ("dsd", "tok", {}) and calls == [64]


def test_a_row_may_change_the_mixed_precision_of_the_row_before_it():
    """Accelerate keeps one state per process and its Accelerator refuses another mixed precision once it
    exists (the accelerate backend's bf16 row after its fp32 baseline): the worker resets it between rows."""
    from accelerate import Accelerator
    try:
        Accelerator(mixed_precision="no", cpu=True)
        worker._reset_process_state()
        assert Accelerator(mixed_precision="bf16", cpu=True).mixed_precision == "bf16"
    finally:
        worker._reset_process_state()  # leave no state to the tests after this one


def test_what_a_row_compiled_is_still_compiled_for_the_next_row():
    """Issue 64: a warm-up is paid once per worker. Between rows the worker keeps TorchDynamo's compiled code,
    so the next window of a compiled row (a new model of the same shapes) compiles nothing again; a reset of
    TorchDynamo would make every window compile anew (inside its step 1, or its later steps after a new shape)."""
    import torch

    from onegpu.measure import compilation

    def build():
        torch.manual_seed(0)
        return torch.compile(torch.nn.Linear(4, 3), backend="eager")

    laps = compilation.Compilations()
    build()(torch.ones(2, 4)).sum().backward()
    assert laps.lap() > 0.0
    worker._reset_process_state()
    build()(torch.ones(2, 4)).sum().backward()  # the next row's model: the same code, the same guards
    assert laps.lap() == 0.0
