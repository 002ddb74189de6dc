"""One tradeoffs batch (onegpu.tradeoffs.batch): its kept plan, its rows validated before anything is
queued, and which run stands for each row."""
from __future__ import annotations

import json

import pytest
import yaml

from onegpu import config
from onegpu.compare import RunRecord
from onegpu.errors import UserError
from onegpu.tradeoffs import batch, knobs
from tests import defaults


def test_a_kept_plan_gives_back_its_variants_and_the_latest_is_the_default(tmp_path, monkeypatch):
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))
    with pytest.raises(UserError, match="no tradeoffs batch queued in this project yet"):
        batch.load_plan(None)
    variants, skipped = knobs.plan(config.from_container(defaults.params()), config.DeviceFacts())
    batch.save("0101-000000", variants[:2], skipped, {"overrides": ["model.dropout=0"]})
    batch.save("0101-000001", variants, skipped, {})
    import os
    os.utime(tmp_path / ".onegpu" / "tradeoffs" / "0101-000000.json", (1, 1))  # the older file
    assert batch.load_plan(None)["batch"] == "0101-000001"
    kept = batch.load_plan("tradeoffs-0101-000000")  # the experiment-name prefix is accepted
    assert batch.variants_of(kept) == variants[:2] and kept["overrides"] == ["model.dropout=0"]
    assert kept["skipped"] == skipped
    with pytest.raises(UserError, match="no tradeoffs batch '0202-000000' .*0101-000000, 0101-000001"):
        batch.load_plan("0202-000000")


def test_a_row_whose_params_do_not_validate_stops_the_batch_naming_the_row(tmp_path):
    raw = defaults.params()
    raw["train"]["fp16"] = True
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump(raw))
    cfg = config.from_container(raw)
    with pytest.raises(UserError,
                       match="row baseline \\(-S 'train.bf16=true'\\) does not validate: .*choose at most one"):
        batch.plan(cfg, str(params), ("split",), ["train.bf16=true"], config.DeviceFacts())
    variants, _ = batch.plan(cfg, str(params), ("split",), ["model.dropout=0"], config.DeviceFacts())
    assert [v.overrides[0] for v in variants] == [("model.dropout", "0")] * 2


def test_each_row_is_its_latest_finished_run_else_its_latest_run():
    """A stopped or failed run stays its row's run (the row then says so) unless a finished one exists."""
    def rec(name, status="FINISHED", done=True, run_id=None):
        return RunRecord(run_id=run_id or name, name=f"tradeoffs-1-{name}", status=status,
                         metrics={"train_runtime": 1.0} if done else {})
    runs = batch.finished_runs([rec("baseline", run_id="old"), rec("baseline", run_id="new"),
                                rec("baseline", status="KILLED", done=False, run_id="stopped-later"),
                                rec("bf16", status="FAILED"), rec("split-16x1", status="KILLED", done=False)],
                               "tradeoffs-1-")
    assert {k: r.run_id for k, r in runs.items()} == {"baseline": "new", "bf16": "bf16", "split-16x1": "split-16x1"}


@pytest.mark.parametrize("differs", [True, False])
def test_start_says_when_the_baseline_params_differ_from_git(monkeypatch, capsys, fresh_root, differs):
    """A workspace `dvc exp run -S` (the README's `auto` example) leaves its values in params.yaml; the
    baseline is then that file, and the command says so."""
    from pathlib import Path

    from onegpu import paths
    monkeypatch.setattr(batch.queue, "queue", lambda prefix, variants, targets, window: None)
    monkeypatch.setattr(paths, "params_differ_from_head", lambda params: differs)
    defaults.write_params(Path.cwd())
    cfg = config.from_container(defaults.params())
    batch.start(cfg, "params.yaml", ("split",), [], True, config.DeviceFacts(cuda=False, gpus=0, bf16=True,
                                                                               packages=frozenset()))
    out = capsys.readouterr().out
    assert ("note: params.yaml differs from git's HEAD (`git diff params.yaml`): the baseline is the file "
            "as it is" in out) == differs, out


def test_rows_run_in_interleaved_rounds_with_the_probe_window_before_their_own_params(tmp_path, monkeypatch, capsys):
    """The window (-S train.max_steps=N, up to train) reaches every row, the baseline too, but is no
    row's override: a recommendation never carries it. A user's own -S train.max_steps is the window."""
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    defaults.write_params(tmp_path)
    cfg = config.from_container(defaults.params())
    calls = []
    monkeypatch.setattr(batch.queue, "run_rows", lambda prefix, rows, targets, force, window: (
        calls.append(([v.name for v in rows], targets, force, window)) or ([], False)))
    monkeypatch.setattr(batch.queue, "states", lambda: {})
    facts = config.DeviceFacts(cuda=False, gpus=0, bf16=True, packages=frozenset())
    name, interrupted = batch.start(cfg, "params.yaml", ("split", "checkpointing"), [], False, facts, 10, 2)
    assert not interrupted
    (names, targets, force, window), = calls
    assert names == ["baseline", "split-16x1", "checkpointing", "baseline-r2", "split-16x1-r2", "checkpointing-r2"]
    assert targets == ["train"] and force == set()
    assert window == ["-S", "train.max_steps=10", "-S", "train.eval_strategy=no", "-S",
                      "train.load_best_model_at_end=false", "-S", "train.early_stopping_patience=null"]
    kept = batch.load_plan(name)
    assert kept["steps"] == 10 and kept["repeats"] == 2
    assert all(("train.max_steps", "10") not in v.overrides for v in batch.variants_of(kept))
    batch.start(cfg, "params.yaml", ("split",), ["train.max_steps=4"], False, facts, 10, 1)
    assert calls[-1][3][:2] == ["-S", "train.max_steps=4"] and "train.eval_strategy=no" in calls[-1][3]
    batch.start(cfg, "params.yaml", ("split",), [], False, facts, None, 1)  # --full: whole pipeline, --force
    assert calls[-1][1:] == ([], {"baseline"}, [])


def test_rows_stopped_by_ctrl_c_are_stopped_in_the_report_and_the_wall_times_are_kept(tmp_path, monkeypatch, capsys):
    """Ctrl-C in row 2 of 3: row 2 says stopped (its run never opened), row 3 not run; the batch is
    incomplete; the plan keeps each row's wall time, and the timing note gives the overhead."""
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))
    variants, _ = knobs.plan(config.from_container(defaults.params()), config.DeviceFacts(), ("split", "attention"))
    batch.save("0101-000000", variants, [], {"steps": 10, "repeats": 1})
    monkeypatch.setattr(batch.queue, "run_rows", lambda prefix, rows, targets, force, window: (
        [batch.queue.Ran(f"{prefix}baseline", 0, 30.0), batch.queue.Ran(f"{prefix}{rows[1].name}", None, 4.0)], True))
    assert batch.run("0101-000000", variants, 10, None) is True
    manifest = batch.load_plan(None)
    assert manifest["stopped"] == [variants[1].name] and manifest["wall_s"]["baseline"] == 30.0
    base = RunRecord(run_id="b", name="tradeoffs-0101-000000-baseline", status="SCHEDULED",
                     metrics={"train_runtime": 12.0}, series={"loss": [(1, 1.0)], "step_time_s": [(1, 1.0)]})
    m = batch.measure(manifest, lambda: {"baseline": base}, None, True, False, "here", {}, True)
    assert [r.verdict for r in m.rows] == ["baseline", "stopped", "not run"] and m.interrupted
    assert m.recommendation.incomplete == (1, 3) and m.measured is None
    note = batch.timing(manifest, {"baseline": base})
    assert note == ["the rows took 34 s of wall time (2 dvc exp run --temp, one at a time); per row a median "
                    "18.0 s (min 18.0, max 18.0) beyond its training: DVC's temporary clone, each stage's process "
                    "start, model load and save"]


def test_the_workers_start_is_said_apart_from_the_rows_wall_time():
    """Issue 64: the workers start at once before the rows (Pool.ready): the note says those seconds apart
    and a row's overhead is its model's build and MLflow run only."""
    base = RunRecord(run_id="b", name="tradeoffs-0101-000000-baseline", status="FINISHED",
                     metrics={"train_runtime": 3.5}, series={"loss": [(1, 1.0)]})
    manifest = {"runner": batch.WORKERS, "wall_s": {"baseline": 4.0, "split": 3.0}, "ready_s": 6.4}
    assert batch.timing(manifest, {"baseline": base}) == [
        "the rows took 7 s of wall time (2 rows in worker processes, one at a time); per row a median 0.5 s "
        "(min 0.5, max 0.5) beyond its training: the model's build and its MLflow run; before the rows, 6 s "
        "starting the workers (at once) and preparing the data"]


def test_the_expected_time_is_the_windows_times_the_median_row_of_an_earlier_batch_with_this_window(tmp_path,
                                                                                                    monkeypatch):
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))
    none = "expected time: known after the first row (no earlier batch with this window here)"
    assert batch.expected_time((12, 28), 6, batch.WORKERS, "0102-000000") == none
    batch.save("0101-000000", [], [], {"steps": 6, "runner": batch.WORKERS})
    plan = batch.load_plan("0101-000000")
    plan["wall_s"] = {"split": 4.0, "lora": 6.5, "compile": 40.0}
    (tmp_path / ".onegpu" / "tradeoffs" / "0101-000000.json").write_text(json.dumps(plan))
    assert batch.expected_time((12, 28), 6, batch.WORKERS, "0102-000000") == (  # no baseline: the median row
        "expected: about 1 min 18 s to 3 min 02 s (a row took a median 6.5 s in batch 0101-000000 here)")
    # the baseline's windows, not rows that compiled for tens of seconds (a cold inductor cache)
    plan["wall_s"] = {"baseline": 5.0, "adamw_torch_8bit": 38.0, "compile": 40.0, "baseline-r2": 5.0}
    (tmp_path / ".onegpu" / "tradeoffs" / "0101-000000.json").write_text(json.dumps(plan))
    assert batch.expected_time((12, 28), 6, batch.WORKERS, "0102-000000") == (
        "expected: about 1 min 00 s to 2 min 20 s (a baseline window took a median 5.0 s in batch 0101-000000 here)")
    assert batch.expected_time((4, 4), 6, batch.WORKERS, "0102-000000").startswith("expected: about 20 s (")
    assert batch.expected_time((12, 28), 10, batch.WORKERS, "0102-000000") == none  # another window
    assert batch.expected_time((12, 28), 6, batch.DVC_TEMP, "0102-000000") == none  # another runner
