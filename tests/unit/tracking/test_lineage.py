"""Which run evaluate logs into when the model was trained in another clone (``tracking.lineage``).

Two project roots, each with its own default store (``<root>/mlflow.db``), stand for two clones; the
record is what train writes to ``models/mlflow_run.json``.
"""
from __future__ import annotations

import pytest

from onegpu import tracking
from onegpu.tracking import lineage


@pytest.fixture(scope="module")
def clones(tmp_path_factory):
    """Clone A (trained: its store holds the training run, SCHEDULED as train leaves it) and clone B
    (an empty store of its own). Returns (tracker A, tracker B, the record train wrote in A)."""
    a = tmp_path_factory.mktemp("clone-a").resolve()
    b = tmp_path_factory.mktemp("clone-b").resolve()
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        mp.delenv("DVC_EXP_NAME", raising=False)
        mp.setenv("DVC_ROOT", str(a))
        mp.chdir(a)
        ta = tracking.connect("onegpu", root=a)
        tb = tracking.connect("onegpu", root=b)
        trained = ta.start_run("exp-7", {"stage": "train", "equivalence_key": "k123"})
        ta.end_run(trained, "SCHEDULED")
        record = lineage.run_record(trained, ta.experiment_id, "k123", ta.uri, "exp-7")
        yield ta, tb, record


def test_run_record_names_the_store_without_its_password():
    rec = lineage.run_record("r1", "3", "k", "http://alice:s3cret@mlflow.example:5000", None)
    assert rec == {"run_id": "r1", "experiment_id": "3", "equivalence_key": "k", "run_name": None,
                   "tracking_uri": "http://alice:***@mlflow.example:5000"}


def test_a_store_that_has_the_training_run_gets_the_evaluation_in_that_run(clones):
    ta, _, record = clones
    run_id, reproduces = tracking.open_evaluation_run(ta, record, {"train.seed": 1})
    assert (run_id, reproduces) == (record["run_id"], None)
    assert ta.run_status(run_id) == "RUNNING"
    ta.end_run(run_id)
    exp_runs = ta.client.search_runs([ta.experiment_id])
    assert [r.info.run_id for r in exp_runs] == [record["run_id"]]  # no second run


def test_another_store_gets_a_run_linked_both_ways_and_reuses_it(clones):
    ta, tb, record = clones
    run_id, reproduces = tracking.open_evaluation_run(tb, record, {"train.seed": 1, "model.task": "x"})
    assert reproduces == record["run_id"] and run_id != record["run_id"]
    new = tb.client.get_run(run_id)
    assert new.info.status == "RUNNING" and new.info.run_name == "exp-7"
    assert new.data.tags["onegpu.reproduces_run_id"] == record["run_id"]
    assert new.data.tags["onegpu.reproduces_store"] == ta.uri
    assert new.data.tags["stage"] == "evaluate"  # not a training run for compare or the UI's view
    assert new.data.tags["equivalence_key"] == "k123"
    assert new.data.params == {"train.seed": "1", "model.task": "x"}
    tb.end_run(run_id)
    back = ta.client.get_run(record["run_id"]).data.tags
    assert back["onegpu.reproduced_by"] == run_id
    assert back["onegpu.reproduced_by_store"] == tb.uri

    again, reproduces = tracking.open_evaluation_run(tb, record, {"train.seed": 1, "model.task": "x"})
    assert (again, reproduces) == (run_id, record["run_id"])  # the same reproducing run, re-opened
    tb.end_run(again)
    assert len(tb.client.search_runs([tb.experiment_id])) == 1
    assert ta.client.get_run(record["run_id"]).data.tags["onegpu.reproduced_by"] == run_id


def test_an_unreachable_original_store_is_said_and_left_uncreated(clones, tmp_path, capsys):
    _, tb, record = clones
    gone = tmp_path / "elsewhere" / "mlflow.db"
    rec = {**record, "run_id": "0" * 32, "tracking_uri": f"sqlite:///{gone}"}
    run_id, reproduces = tracking.open_evaluation_run(tb, rec, {})
    tb.end_run(run_id)
    assert reproduces == "0" * 32
    assert tb.client.get_run(run_id).data.tags["onegpu.reproduces_store"] == f"sqlite:///{gone}"
    assert "cannot be tagged from here" in capsys.readouterr().err
    assert not gone.exists() and not gone.parent.exists()  # MLflow would have created an empty store


def test_a_run_file_from_before_the_store_was_recorded_still_evaluates(clones, capsys):
    _, tb, record = clones
    old = {"run_id": "1" * 32, "experiment_id": "1", "equivalence_key": "k123"}
    run_id, reproduces = tracking.open_evaluation_run(tb, old, {})
    tb.end_run(run_id)
    tags = tb.client.get_run(run_id).data.tags
    assert reproduces == "1" * 32 and "onegpu.reproduces_store" not in tags
    assert capsys.readouterr().err == ""
