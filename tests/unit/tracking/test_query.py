"""Compare-time queries (onegpu.tracking.query) on a real SQLite store: training runs as RunRecord
fields, their per-step histories and windows, the filters and their errors, the comparison run."""
from __future__ import annotations

import time

import pytest
from mlflow.entities import Metric

from onegpu import tracking
from onegpu.errors import UserError


def _log(tracker, run_id: str, key: str, points: list[tuple[int, float, int]]) -> None:
    """``(step, value, timestamp ms)`` points of metric ``key``."""
    tracker.client.log_batch(run_id, metrics=[Metric(key, v, ts, s) for s, v, ts in points], synchronous=True)


@pytest.fixture(scope="module")
def store(store_root):
    """Two training runs (keys abc1.., abd2..), the second named like a tradeoffs row, and a compare run."""
    tr = tracking.connect("query")
    a = tr.start_run("exp-a", {"stage": "train", "equivalence_key": "abc1" + "0" * 12, "dvc.exp_name": "exp-a"})
    # step 2 logged twice (a resumed run re-logs it): the later value wins; the store sorts nothing for us
    _log(tr, a, "loss", [(2, 0.9, 1_000_020), (1, 1.0, 1_000_010), (2, 0.8, 1_000_030)])
    _log(tr, a, "step_time_s", [(1, 0.5, 1_000_010), (2, 0.5, 1_000_030)])
    tr.log_params(a, {"train.per_device_train_batch_size": 8})
    tr.end_run(a, "FINISHED")
    time.sleep(0.01)  # a later start time
    b = tr.start_run("tradeoffs-1-baseline", {"stage": "train", "equivalence_key": "abd2" + "0" * 12,
                                              "onegpu.train_start_ms": "5", "onegpu.train_end_ms": "9"})
    _log(tr, b, "loss", [(1, 2.0, 2_000_000)])
    c = tr.start_run("compare", {"stage": "compare"})
    return tr, a, b, c


def test_training_runs_are_records_oldest_first_with_sorted_histories_and_windows(store):
    tr, a, b, _ = store
    recs = tracking.training_runs(tr)
    assert [r["run_id"] for r in recs] == [a, b]  # the compare run is not a training run
    first = recs[0]
    assert first["series"]["loss"] == [(1, 1.0), (2, 0.8)] and first["metrics"]["loss"] == 0.8
    assert first["window"] == (1_000_010, 1_000_030)  # from step_time_s: no window tags
    assert first["params"] == {"train.per_device_train_batch_size": "8"} and first["status"] == "FINISHED"
    assert recs[1]["window"] is None and recs[1]["status"] == "RUNNING"  # the tags give its window
    assert set(first) == {"run_id", "name", "params", "tags", "metrics", "series", "start_time", "status", "window"}
    from onegpu.compare import RunRecord
    assert RunRecord(**first).micro_batch == 8 and RunRecord(**recs[1]).train_window == (5, 9)


def test_filters_by_key_prefix_run_id_and_experiment_name_and_their_errors(store):
    tr, a, b, c = store
    assert [r["run_id"] for r in tracking.training_runs(tr, key="abd")] == [b]
    with pytest.raises(UserError, match="matches several equivalence keys"):
        tracking.training_runs(tr, key="ab")
    assert [r["run_id"] for r in tracking.training_runs(tr, run_ids=[b, a, b])] == [a, b]
    with pytest.raises(UserError, match="is not a training run \\(tag stage='compare'\\)"):
        tracking.training_runs(tr, run_ids=[c])
    with pytest.raises(UserError, match="no MLflow run 'nope'"):
        tracking.training_runs(tr, run_ids=["nope"])
    assert [r["run_id"] for r in tracking.training_runs(tr, exp_names=["exp-a"])] == [a]
    with pytest.raises(UserError, match="no training run for DVC experiment\\(s\\) exp-z"):
        tracking.training_runs(tr, exp_names=["exp-a", "exp-z"])


def test_runs_named_by_prefix_and_windows_of_every_training_run(store):
    tr, a, b, _ = store
    assert [r["run_id"] for r in tracking.training_runs_named(tr, "tradeoffs-1-")] == [b]
    assert tracking.training_runs_named(tr, "exp-b") == []
    windows = tracking.training_run_windows(tr)
    assert {w["run_id"] for w in windows} == {a, b} and all("series" not in w for w in windows)


def test_the_comparison_run_is_finished_with_its_files_tags_and_counts(store, tmp_path):
    tr, a, b, _ = store
    report = tmp_path / "compare.md"
    report.write_text("# report\n")
    run_id = tracking.log_comparison(tr, [report], [a, b], ["abc1" + "0" * 12], {"compare_runs": 2})
    run = tr.client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "compare-abc10000"
    assert run.data.tags["stage"] == "compare" and run.data.tags["compare.run_ids"] == f"{a},{b}"
    assert run.data.tags["equivalence_key"] == "abc1" + "0" * 12 and run.data.metrics == {"compare_runs": 2.0}
    assert [f.path for f in tr.client.list_artifacts(run_id)] == ["compare.md"]
    two = tr.client.get_run(tracking.log_comparison(tr, [], [a, b], ["k1", "k2"], stage="tradeoffs", name="t-1"))
    assert two.info.run_name == "t-1" and "equivalence_key" not in two.data.tags
    assert two.data.tags["stage"] == "tradeoffs"
