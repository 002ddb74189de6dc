"""The trained model as an MLflow logged model (onegpu.tracking.models, Tracker.log_model): external (no
model bytes in the store), linked to its training run, its metrics linked to it and to a dataset; found
again rather than made twice; an outage costs the model record only."""
from __future__ import annotations

import json

import pandas as pd
import pytest
import requests

from onegpu import tracking
from onegpu.config import from_container
from onegpu.models import record
from onegpu.tracking import models

SPEC = tracking.ModelSpec(name="bs4x4-fp32", params={"equivalence_key": "k" * 16, "finetuning": "full"},
                          tags={"onegpu.model_dir": "models/model"}, model_type="sequence-classification")


@pytest.fixture(scope="module")
def store(store_root):
    return tracking.connect("models")


def _artifact_files(uri: str) -> dict[str, int]:
    from pathlib import Path
    root = Path(uri[len("file://"):])
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*") if p.is_file()}


def test_the_trained_model_is_an_external_logged_model_of_its_run_with_its_params_and_tags(store):
    rid = store.start_run("r", {"stage": "train"})
    model_id = store.log_model(rid, SPEC)
    m = store.client.get_logged_model(model_id)
    assert (m.name, m.source_run_id, m.model_type, str(m.status)) == (
        "bs4x4-fp32", rid, "sequence-classification", "READY")
    assert m.params == SPEC.params
    assert m.tags["onegpu.model_dir"] == "models/model" and m.tags[models.IS_EXTERNAL] == "true"
    # the run's output (its page's "Logged models"), and nothing but MLflow's MLmodel file in the store
    assert [o.model_id for o in store.client.get_run(rid).outputs.model_outputs] == [model_id]
    files = _artifact_files(m.artifact_location)
    assert list(files) == ["MLmodel"] and files["MLmodel"] < 2_000
    store.end_run(rid)


def test_the_model_is_found_again_not_made_twice_and_gets_the_newer_tags(store):
    rid = store.start_run("r2", {"stage": "train"})
    first = store.log_model(rid, SPEC)
    later = tracking.ModelSpec(name="ignored", tags={"onegpu.dvc_out": "models@abc.dir"})
    assert store.log_model(rid, later) == first
    found = store.client.search_logged_models([store.experiment_id], filter_string=f"source_run_id = '{rid}'")
    assert [m.model_id for m in found] == [first]
    tags = store.client.get_logged_model(first).tags
    assert tags["onegpu.dvc_out"] == "models@abc.dir" and tags["onegpu.model_dir"] == "models/model"
    assert models.find(store.client, store.experiment_id, "0" * 32) is None
    store.end_run(rid)


def test_evaluate_metrics_belong_to_the_run_and_to_the_model_on_the_test_dataset(store):
    rid = store.start_run("r3", {"stage": "train"})
    model_id = store.log_model(rid, SPEC)
    df = pd.DataFrame({"text": ["a b", "c d", "e f"], "label": [0, 1, 0]})
    [test] = store.log_data_inputs(rid, [(df, "bbcnews-test", "evaluation")], "data/processed@x.dir")
    assert test[0] == "bbcnews-test" and len(test[1]) == 8
    store.log_metrics(rid, {"test_accuracy": 0.75, "test_loss": 0.5}, model_id=model_id, dataset=test)
    assert store.client.get_run(rid).data.metrics == {"test_accuracy": 0.75, "test_loss": 0.5}
    linked = {m.key: (m.value, m.model_id, m.dataset_name, m.dataset_digest)
              for m in store.client.get_logged_model(model_id).metrics}
    assert linked == {"test_accuracy": (0.75, model_id, *test), "test_loss": (0.5, model_id, *test)}
    store.end_run(rid)


class _DownClient:
    """A store that is not there: every call fails as a refused connection does."""

    def __getattr__(self, name):
        def fail(*a, **k):
            raise requests.exceptions.ConnectionError("Connection refused")
        return fail


def test_an_outage_costs_the_model_record_only_and_its_metrics_are_spooled_with_the_link(tmp_path, capsys):
    tr = tracking.Tracker(client=_DownClient(), experiment_id="1", uri="http://store:5000", spool_dir=tmp_path)
    assert tr.log_model("r1", SPEC) is None
    assert "evaluate records it" in capsys.readouterr().err
    tr.log_metrics("r1", {"test_accuracy": 0.5}, model_id="m-1", dataset=("bbcnews-test", "abcd1234"))
    [rec] = [json.loads(ln) for ln in (tmp_path / "r1.jsonl").read_text().splitlines()]
    assert rec["kind"] == "metrics" and rec["items"][0][0] == "test_accuracy"
    assert rec["items"][0][4:] == ["m-1", "bbcnews-test", "abcd1234"]
    with pytest.raises(requests.exceptions.ConnectionError):  # without a spool a failure is the caller's
        tracking.Tracker(client=_DownClient(), experiment_id="1", uri="http://store:5000").log_model("r1", SPEC)


def test_evaluate_gets_trains_model_with_the_dvc_hash_only_from_a_lock_dvc_wrote_in_this_pipeline(tmp_path,
                                                                                              monkeypatch):
    import dataclasses
    monkeypatch.chdir(tmp_path)
    (tmp_path / "dvc.lock").write_text("schema: '2.0'\nstages:\n  train:\n    outs:\n    - path: models\n"
                                       "      md5: 0123456789abcdef0123456789abcdef.dir\n")
    spec = record.logged_model(from_container({}), "k", "n")
    kept = dataclasses.asdict(spec)  # as models/mlflow_run.json keeps it
    monkeypatch.delenv("DVC_STAGE", raising=False)
    assert models.locked(kept) == spec  # by hand: the lock may be older than models/
    monkeypatch.setenv("DVC_STAGE", "evaluate")
    got = models.locked(kept)
    assert got.tags == {**spec.tags, models.DVC_OUT_TAG: "models@0123456789abcdef0123456789abcdef.dir"}
    assert (got.name, got.params, got.model_type) == (spec.name, spec.params, spec.model_type)
    assert models.DVC_OUT_TAG not in kept["tags"]  # the record itself is not changed


class _Counting:
    """The store's client, counting the calls made through it."""

    def __init__(self, client):
        self.client, self.calls = client, []

    def __getattr__(self, name):
        self.calls.append(name)
        return getattr(self.client, name)


def test_a_model_costs_the_store_one_search_and_four_writes_then_one_search_and_one_write(store):
    rid = store.start_run("counted", {"stage": "train"})
    counting = _Counting(store.client)
    tr = tracking.Tracker(client=counting, experiment_id=store.experiment_id, uri=store.uri)
    tr.log_model(rid, SPEC)  # train
    assert counting.calls == ["search_logged_models", "create_logged_model", "log_model_artifacts",
                              "finalize_logged_model", "log_outputs"]
    counting.calls.clear()
    tr.log_model(rid, SPEC)  # evaluate: found, its tags set again (the DVC hash)
    assert counting.calls == ["search_logged_models", "set_logged_model_tags"]
    store.end_run(rid)
