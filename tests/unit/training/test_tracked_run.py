"""The tracked training run (onegpu.training.tracked_run): the MLflow run around the session's training:
its name, outside load and figure, a failed or stopped run's record, the auto finder's logging."""
from __future__ import annotations

import pytest

pytest.importorskip("torch")

from onegpu.config import from_container  # noqa: E402
from onegpu.training import session, tracked_run  # noqa: E402
from onegpu.training.record import closing_record, run_tags

STATS = {"fingerprint": "f" * 16, "labels": ["a", "b"]}
AUTO = {"per_device_train_batch_size": "auto", "effective_batch_size": 8, "memory_budget_gib": 1}


def _cfg(**train):
    return from_container({"train": train}, source="test")


def test_the_auto_finder_probes_under_the_trainings_precision(tmp_path, monkeypatch, tokenizer, dsd):
    """With bf16 the finder must probe under autocast (bf16 activations are smaller, so a larger
    micro-batch fits); the session used to call it without the precision."""
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))
    seen = _stub_finder(monkeypatch, 4)
    import torch
    plan = session.plan(_cfg(**AUTO, bf16=True), STATS)
    micro = tracked_run._find_micro_batch(torch.nn.Linear(2, 2), tokenizer, dsd, plan, _NoLogs(), "run")
    assert micro == 4 and seen["mixed_precision"] == "bf16"


def _stub_finder(monkeypatch, micro: int) -> dict:
    """autobatch.find_micro_batch replaced by one returning ``micro``; returns the keywords it was called with."""
    from onegpu.training.memory import autobatch
    seen = {}

    def finder(*args, **kw):
        seen.update(kw)
        return micro, []
    monkeypatch.setattr(autobatch, "find_micro_batch", finder)
    return seen


class _NoLogs:
    """A tracker whose artifact logging does nothing."""

    def log_dict(self, *a):
        pass

    def log_text(self, *a):
        pass


def test_under_fsdp2_the_auto_finder_sizes_one_ranks_shards(tmp_path, monkeypatch, tokenizer, dsd, capsys):
    """train.fsdp: the finder's states are one rank's (sharding.per_rank_bytes over train.num_processes, at the
    accumulation each micro-batch implies), and its line says the budget is per rank; without sharding, the whole
    model's (states_at None)."""
    from onegpu.training.parallel import sharding
    from tests.unit.tiny import tiny_bert
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))
    seen = _stub_finder(monkeypatch, 2)
    model = tiny_bert()
    two = {**AUTO, "backend": "accelerate", "num_processes": 2, "oom_retry": False, "eval_strategy": "no"}
    plan = session.plan(_cfg(**two, fsdp={"enabled": True}), STATS)
    assert tracked_run._find_micro_batch(model, tokenizer, dsd, plan, _NoLogs(), "run") == 2
    optim = plan.cfg.train.optim
    assert seen["states_at"](2) == sharding.per_rank_bytes(model, 2, 2, optim, True)  # 8 = 2 x 2 x 2 processes
    assert seen["states_at"](4) == sharding.per_rank_bytes(model, 2, 1, optim, True)
    assert "(budget 1.00 GiB per rank: its FSDP2 shards of the states and the gathered weights, predicted" in \
        capsys.readouterr().out
    tracked_run._find_micro_batch(model, tokenizer, dsd, session.plan(_cfg(**two), STATS), _NoLogs(), "run")
    assert seen["states_at"] is None


def _tiny_run(root, tokenizer, dsd, fail_at: int | None = None, run: dict | None = None, **train):
    """tracked_run.run of a 2-layer BERT on the 32-row dsd into ``root``'s store; ``fail_at``: the sink raises
    at that optimizer step (a failing training); ``run``: more arguments of tracked_run.run. Returns (run id,
    MlflowClient)."""
    run = run or {}
    from onegpu import tracking
    from tests.unit.tiny import tiny_bert
    cfg = _cfg(per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=3, **train)
    plan = session.plan(cfg, {"fingerprint": "f" * 16, "labels": dsd["train"].features["label"].names})
    tracker = tracking.connect("test", root=root)
    if fail_at is not None:
        real = tracker.metric_buffer

        def failing_buffer(run_id, *a, **kw):
            buffer = real(run_id, *a, **kw)
            add = buffer.add

            def add_then_fail(metrics, step):
                add(metrics, step)
                if step == fail_at:
                    raise RuntimeError("boom")
            buffer.add = add_then_fail
            return buffer
        tracker.metric_buffer = failing_buffer
        with pytest.raises(RuntimeError, match="boom"):
            tracked_run.run(plan, tracker, dsd, built=(tiny_bert(), tokenizer))
        return tracker.client.search_runs([tracker.experiment_id])[0].info.run_id, tracker.client
    return tracked_run.run(plan, tracker, dsd, built=(tiny_bert(), tokenizer), **run).run_id, tracker.client


def test_a_training_run_logs_its_outside_load_its_figure_and_a_name_from_its_params(fresh_root, tokenizer, dsd):
    """Issue 20 items 3 and 8: the run carries what other processes took of the machine while it trained
    (tag onegpu.outside_load, metric train_outside_cpu_load), a PNG of loss/grad_norm/memory/speed per step,
    and, outside a DVC experiment, a name from its settings instead of MLflow's random one."""
    from onegpu.measure import outside_load
    from onegpu.training.record import figure
    run_id, client = _tiny_run(fresh_root, tokenizer, dsd, gradient_checkpointing=True)
    run = client.get_run(run_id)
    info = outside_load.parse(run.data.tags[outside_load.TAG])
    assert info["cpus"] >= 1 and info["cpu_busy"] >= 0 and info["window_s"] > 0
    assert run.data.metrics[outside_load.METRIC] == info["cpu_busy"]
    assert run.info.run_name == "bs4x2-fp32-ckpt" == run.data.tags[run_tags.CONFIG_TAG]
    png = [a.path for a in client.list_artifacts(run_id)]
    assert figure.FIGURE in png and figure.THUMBNAIL in png
    # the run page's description shows the figure; the runs table gets memory and speed in people's units
    assert run.data.tags["mlflow.note.content"].startswith(
        f'<a href="get-artifact?path={figure.FIGURE}&amp;run_uuid={run_id}"><img src="get-artifact?path='
        f'{figure.THUMBNAIL}&amp;run_uuid={run_id}"')
    assert run.data.tags["memory"].endswith(("MiB", "GiB"))
    assert run.data.tags["speed"] == f"{run.data.metrics['train_samples_per_second']:.2f} samples/s"
    assert run.data.tags["outside_load"] == f"{info['share']:.0%} of {info['cpus']} CPUs"
    # a new experiment is MLflow's machine-learning kind, so its UI opens on the training runs
    assert client.get_experiment(run.info.experiment_id).tags["mlflow.experimentKind"] == "custom_model_development"


def test_a_failed_training_still_logs_the_figure_of_the_steps_it_measured(fresh_root, tokenizer, dsd):
    from onegpu.measure import outside_load
    from onegpu.training.record import figure
    run_id, client = _tiny_run(fresh_root, tokenizer, dsd, fail_at=2)
    run = client.get_run(run_id)
    assert run.info.status == "FAILED"
    assert figure.FIGURE in [a.path for a in client.list_artifacts(run_id)]
    assert outside_load.TAG in run.data.tags


class _Killed(BaseException):
    """Stands for SIGTERM's default action (the process ends at once) in this test process."""


def test_a_sigterm_while_a_failed_run_is_closed_waits_until_its_steps_error_and_figure_are_written(
        fresh_root, tokenizer, dsd, monkeypatch):
    """Issue 30: a rank's collective fails (the sink raises at step 2) and torchrun's closing SIGTERM
    arrives while the run's record is written: the signal waits, so the FAILED run keeps its own error,
    every step it measured and its figure."""
    import os
    import signal

    from onegpu.training.record import figure

    def killed(signum, frame):
        raise _Killed()
    real_closing = closing_record.log_closing

    def closing_with_sigterm(*a, **kw):
        os.kill(os.getpid(), signal.SIGTERM)  # torchrun stops the surviving ranks
        return real_closing(*a, **kw)
    monkeypatch.setattr(closing_record, "log_closing", closing_with_sigterm)
    old = signal.signal(signal.SIGTERM, killed)
    try:
        run_id, client = _tiny_run(fresh_root, tokenizer, dsd, fail_at=2)
    finally:
        signal.signal(signal.SIGTERM, old)
    run = client.get_run(run_id)
    assert run.info.status == "FAILED" and run.data.tags["error.type"] == "RuntimeError"
    assert [m.step for m in client.get_metric_history(run_id, "loss")] == [1, 2]
    assert figure.FIGURE in [a.path for a in client.list_artifacts(run_id)]


def test_a_full_disk_while_logging_the_runs_figure_fails_the_run_naming_the_artifact_and_the_free_space(
        fresh_root, tokenizer, dsd, monkeypatch):
    import errno

    from mlflow import MlflowClient

    from onegpu.errors import DiskFullError
    from onegpu.training.record import figure

    def full(*a, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(MlflowClient, "log_figure", full)
    with pytest.raises(DiskFullError) as e:
        _tiny_run(fresh_root, tokenizer, dsd)
    assert "no space left on the device writing mlartifacts/" in str(e.value)
    assert f"/{figure.FIGURE} (" in str(e.value) and " free of " in str(e.value)
    client = MlflowClient(tracking_uri=f"sqlite:///{fresh_root / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("test").experiment_id])
    assert run.info.status == "FAILED" and run.data.tags["error.type"] == "DiskFullError"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [1, 2, 3]  # every step kept


def test_a_probe_row_of_tradeoffs_is_named_by_the_batch_and_gets_no_figure_and_no_checkpoints(fresh_root, tokenizer,
                                                                                              dsd):
    """``onegpu tradeoffs``' worker: the row's own name, the outside load kept (the batch's report reads
    it), no figure (the report plots the rows), no checkpoint folder written or tidied."""
    from onegpu.measure import outside_load
    from onegpu.training.record import figure
    run_id, client = _tiny_run(fresh_root, tokenizer, dsd, run={"name": "row-3", "probe": True})
    run = client.get_run(run_id)
    assert run.info.run_name == "row-3" and run.data.tags[run_tags.CONFIG_TAG] == "bs4x2-fp32"
    assert outside_load.TAG in run.data.tags and figure.NOTE_TAG not in run.data.tags
    assert figure.FIGURE not in [a.path for a in client.list_artifacts(run_id)]
    assert not (fresh_root / ".onegpu" / "checkpoints").exists()
    assert [m.step for m in client.get_metric_history(run_id, "loss")] == [1, 2, 3]
