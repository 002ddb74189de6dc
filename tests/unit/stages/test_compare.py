"""``onegpu compare`` end to end on a temporary SQLite store filled with fake training runs.

The fake runs carry what a real training run logs (every params.yaml leaf, ``resolved.*``, the tags of
the train stage and models.describe, per-step metrics at steps 1..N, train_* and eval_* summaries), so
the command reads them back exactly as it would read real ones. One store serves the module (creating
its schema costs a few seconds).
"""
from __future__ import annotations

import math
import re
import time

import pytest

from onegpu import cli, config, tracking
from tests import defaults
from tests.tables import row

KEY_A = "a1b2c3d4e5f60718"
KEY_B = "b0b0b0b0b0b0b0b0"
STEPS = 6
PNG = b"\x89PNG\r\n\x1a\n"


def _loss(step: int) -> float:
    return 1.6 * math.exp(-0.2 * step) + 0.1


def _log_training_run(tr: tracking.Tracker, name: str, key: str, micro: int, accum: int, *,
                      ckpt: bool = False, dropout: float = 0.0, loss_factor=lambda s: 1.0,
                      mem: float = 2e9, sps: float = 50.0, test_accuracy: float = 0.9) -> str:
    cfg = config.from_container(defaults.params())
    cfg.train.per_device_train_batch_size, cfg.train.gradient_accumulation_steps = micro, accum
    cfg.train.gradient_checkpointing = ckpt
    cfg.model.dropout = dropout
    tags = {"stage": "train", "equivalence_key": key, "device": "cpu", "data.fingerprint": "f" * 16,
            "dvc.exp_name": name, "dvc.baseline_rev": "0" * 40, "mlflow.source.git.commit": "0" * 40,
            "model.class": "BertForSequenceClassification", "model.parameters": "22713216",
            "model.dropout_max": str(dropout), "model.batchnorm_layers": "0"}
    run_id = tr.start_run(name, tags)
    params = config.flatten(cfg.to_dict())
    params.update({"resolved.per_device_train_batch_size": micro, "resolved.gradient_accumulation_steps": accum,
                   "resolved.effective_batch_size": micro * accum, "resolved.world_size": 1})
    tr.log_params(run_id, params)
    buf = tr.metric_buffer(run_id)
    for s in range(1, STEPS + 1):
        buf.add({"loss": _loss(s) * loss_factor(s), "grad_norm": 3.0 / s * loss_factor(s),
                 "learning_rate": 1e-4 * (1 - s / STEPS), "step_time_s": micro * accum / sps,
                 "samples_per_second": sps, "tokens_per_second": sps * 60, "mem_peak_bytes": mem}, step=s)
    buf.flush()
    tr.log_metrics(run_id, {"train_loss": sum(_loss(s) for s in range(1, STEPS + 1)) / STEPS,
                            "train_runtime": STEPS * micro * accum / sps, "train_samples_per_second": sps,
                            "train_tokens_per_second": sps * 60, "train_mem_peak_bytes": mem}, step=STEPS)
    tr.log_metrics(run_id, {"test_loss": 0.4, "test_accuracy": test_accuracy, "test_f1_macro": 0.88,
                            "test_runtime": 1.0, "test_samples_per_second": 400.0,
                            "test_mem_peak_bytes": 1e9})
    tr.end_run(run_id)
    time.sleep(0.002)  # distinct start times
    return run_id


@pytest.fixture(scope="module")
def project(store_root):
    """A project root with params.yaml and a store: experiment 'onegpu' with a prepare run, 4 training
    runs of KEY_A (64x1, 4x16, 64x1 ckpt, 8x8 with dropout diverging at step 3) and 1 of KEY_B;
    experiment 'empty' with a prepare run only."""
    root = store_root
    defaults.write_params(root)
    tr = tracking.connect("onegpu")
    prep = tr.start_run("prepare", {"stage": "prepare"})
    tr.end_run(prep)
    ids = {
        "ref-64x1": _log_training_run(tr, "ref-64x1", KEY_A, 64, 1, mem=4e9, sps=100.0),
        "split-4x16": _log_training_run(tr, "split-4x16", KEY_A, 4, 16, mem=1e9, sps=60.0,
                                        loss_factor=lambda s: 1 + (2e-7 if s == 1 else 2e-6 * s)),  # step 1: the floor
        "ckpt-64x1": _log_training_run(tr, "ckpt-64x1", KEY_A, 64, 1, ckpt=True, mem=2e9, sps=75.0),
        "drop-8x8": _log_training_run(tr, "drop-8x8", KEY_A, 8, 8, dropout=0.1, mem=1.5e9, sps=70.0,
                                      loss_factor=lambda s: 1.0 if s < 3 else 1.03, test_accuracy=0.88),
        "other": _log_training_run(tr, "other", KEY_B, 16, 1),
    }
    empty = tracking.connect("empty")
    empty.end_run(empty.start_run("prepare", {"stage": "prepare"}))
    return root, tr, ids


@pytest.fixture
def in_project(project, monkeypatch):
    root, tr, ids = project
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("DVC_ROOT", str(root))
    monkeypatch.chdir(root)
    return project


def _compare_run_id(stdout: str) -> str:
    m = re.search(r"MLflow comparison run ([0-9a-f]{32})", stdout)
    assert m, stdout
    return m.group(1)


def _table_row(stdout: str, name: str) -> str:
    rows = [line for line in stdout.splitlines() if line.strip().startswith(name + " ")]
    assert len(rows) == 1, stdout
    return rows[0]


def test_compare_reports_verdicts_plots_and_logs_a_comparison_run(in_project, capsys):
    root, tr, ids = in_project
    assert cli.main(["compare"]) == 0
    out = capsys.readouterr().out
    print(out)

    # terminal: one row per run
    assert "equivalent" in _table_row(out, "split-4x16") and "4 x 16" in _table_row(out, "split-4x16")
    assert "equivalent" in _table_row(out, "ckpt-64x1") and " yes " in _table_row(out, "ckpt-64x1")
    assert "diverged at step 3" in _table_row(out, "drop-8x8")
    assert "reference" in _table_row(out, "ref-64x1") and "3,815" in _table_row(out, "ref-64x1")
    assert "prepare" not in out

    md = (root / "reports" / "compare.md").read_text()
    assert f"`{KEY_A}`" in md and f"`{KEY_B}`" in md
    assert "5 training runs" in md
    assert "equivalent" in row(md, "split-4x16") and "equivalent" in row(md, "ckpt-64x1")
    assert "**diverged at step 3**" in row(md, "drop-8x8")
    assert "likely cause: dropout (p up to 0.1) with a different micro-batch (8 vs 64)" in md
    assert 'What "equivalent" means here' in md
    assert "0.25x" in md  # 4x16 uses a quarter of the reference's memory
    for png in ("loss_curves.png", "memory_vs_throughput.png"):
        data = (root / "reports" / png).read_bytes()
        assert data.startswith(PNG) and len(data) > 5000
        import matplotlib.image
        assert matplotlib.image.imread(root / "reports" / png).shape[0] > 100
        assert f"]({png})" in md

    run = tr.client.get_run(_compare_run_id(out))
    assert run.data.tags["stage"] == "compare"
    assert "equivalence_key" not in run.data.tags  # two keys compared
    assert set(run.data.tags["compare.run_ids"].split(",")) == set(ids.values())
    assert run.info.status == "FINISHED"
    assert run.data.metrics["compare_diverged"] == 1 and run.data.metrics["compare_equivalent"] == 2
    arts = {a.path for a in tr.client.list_artifacts(run.info.run_id)}
    assert arts == {"compare.md", "loss_curves.png", "memory_vs_throughput.png"}


def test_compare_one_key_by_prefix_tags_the_comparison_run(in_project, capsys):
    root, tr, ids = in_project
    assert cli.main(["compare", "--key", KEY_A[:6], "--out", "cmp"]) == 0
    out = capsys.readouterr().out
    md = (root / "cmp" / "compare.md").read_text()
    assert KEY_B not in md and "4 training runs" in md
    run = tr.client.get_run(_compare_run_id(out))
    assert run.data.tags["stage"] == "compare" and run.data.tags["equivalence_key"] == KEY_A
    assert run.info.run_name == f"compare-{KEY_A[:8]}"


def test_compare_by_dvc_experiment_names_and_run_ids(in_project, capsys):
    root, tr, ids = in_project
    assert cli.main(["compare", "--exp", "ref-64x1", "drop-8x8", "--out", "by-exp"]) == 0
    out = capsys.readouterr().out
    assert "diverged at step 3" in _table_row(out, "drop-8x8") and "split-4x16" not in out
    assert cli.main(["compare", "--runs", ids["ref-64x1"], ids["split-4x16"], "--out", "by-id"]) == 0
    out = capsys.readouterr().out
    assert "equivalent" in _table_row(out, "split-4x16") and "drop-8x8" not in out


def test_no_training_runs_exits_2_with_one_message(in_project, capsys):
    assert cli.main(["compare", "--experiment", "empty"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("onegpu compare: error: no training runs in MLflow experiment 'empty'")
    assert len(err.strip().splitlines()) == 1
    assert cli.main(["compare", "--exp", "no-such-exp"]) == 2
    assert "no-such-exp" in capsys.readouterr().err
    assert cli.main(["compare", "--runs", "0" * 32]) == 2
    assert "no MLflow run" in capsys.readouterr().err


def test_no_store_exits_2_and_creates_nothing(tmp_path, monkeypatch, capsys):
    defaults.write_params(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    assert cli.main(["compare"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("onegpu compare: error: no MLflow store at") and "no training runs" in err
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "reports").exists()


def test_runs_that_overlapped_in_time_are_marked_not_comparable(in_project, capsys):
    """Issue 9 case 6: two splits trained at once (`dvc queue start -j 2`) shared the cores; compare marks
    their speed and memory in the terminal and compare.md, also when the run they overlapped is of another
    key and outside the --key filter, and reads windows of runs without the tags from step timestamps."""
    root, tr, ids = in_project
    q = tracking.connect("queued")
    key_c, key_d = "c" * 16, "d" * 16
    t0 = 1_700_000_000_000
    windows = {"q-16x1": (t0, t0 + 60_000), "q-4x4-ckpt": (t0 + 100_000, t0 + 200_000),
               "q-8x2": (t0 + 300_000, t0 + 400_000), "q-lr-sweep": (t0 + 150_000, t0 + 350_000)}
    for name, (micro, accum, key, sps) in {"q-16x1": (16, 1, key_c, 50.0), "q-4x4-ckpt": (4, 4, key_c, 21.0),
                                           "q-8x2": (8, 2, key_c, 15.5), "q-lr-sweep": (16, 1, key_d, 30.0)}.items():
        rid = _log_training_run(q, name, key, micro, accum, ckpt=name.endswith("ckpt"), sps=sps)
        q.set_tags(rid, {"onegpu.train_start_ms": str(windows[name][0]), "onegpu.train_end_ms": str(windows[name][1]),
                         "onegpu.machine": "0123456789ab"})
    assert cli.main(["compare", "--experiment", "queued", "--key", key_c, "--out", "q"]) == 0
    out = capsys.readouterr().out
    assert "21.0*" in _table_row(out, "q-4x4-ckpt") and "15.5*" in _table_row(out, "q-8x2")
    assert "*" not in _table_row(out, "q-16x1")
    assert "not comparable" in out and "dvc queue start -j 1" in out
    md = (root / "q" / "compare.md").read_text()
    assert "q-4x4-ckpt trained at the same time as q-lr-sweep" in md
    assert "q-8x2 trained at the same time as q-lr-sweep" in md
    assert "0.31x*" in row(md, "q-8x2")
    # Without the tags (runs from before them), the step metrics' timestamps give the window.
    run = tr.client.search_runs([tr.experiment_id], filter_string="tags.stage = 'train'", max_results=1)[0]
    first, last = tracking.step_window(tr, run)
    hist = tr.client.get_metric_history(run.info.run_id, "step_time_s")
    assert (first, last) == (min(m.timestamp for m in hist), max(m.timestamp for m in hist))


def test_a_run_still_training_is_named_and_left_out_not_reported_as_a_step_mismatch(in_project, capsys):
    root, tr, ids = in_project
    live = tracking.connect("live")
    _log_training_run(live, "done-64x1", KEY_A, 64, 1)
    evaluating = _log_training_run(live, "evaluating-4x16", KEY_A, 4, 16)
    live.resume_run(evaluating)  # evaluate re-opened it: RUNNING, but its training is complete
    halfway = live.start_run("halfway-8x8", {"stage": "train", "equivalence_key": KEY_A, "device": "cpu"})
    buf = live.metric_buffer(halfway)
    for s in range(1, 4):
        buf.add({"loss": _loss(s), "grad_norm": 1.0, "learning_rate": 1e-4}, step=s)
    buf.flush()

    assert cli.main(["compare", "--experiment", "live", "--out", "live"]) == 0
    out = capsys.readouterr().out
    assert (f"left out: MLflow run halfway-8x8 ({halfway}) is still training (3 optimizer steps logged so "
            "far); compare again when it has finished") in out
    assert "equivalent" in _table_row(out, "evaluating-4x16")
    md = (root / "live" / "compare.md").read_text()
    assert "halfway" not in md and "2 training runs" in md

    assert cli.main(["compare", "--experiment", "live", "--runs", halfway]) == 2
    err = capsys.readouterr().err
    assert "all still training: nothing to compare yet" in err
    live.end_run(halfway, "KILLED")
    live.end_run(evaluating)


def test_compare_on_a_deleted_experiment_says_deleted_and_how_to_restore(in_project, capsys):
    gone = tracking.connect("gone")
    gone.client.delete_experiment(gone.experiment_id)
    assert cli.main(["compare", "--experiment", "gone"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"onegpu compare: error: MLflow experiment 'gone' (id {gone.experiment_id}) is deleted in ")
    assert f"mlflow experiments restore --experiment-id {gone.experiment_id}" in err
    assert len(err.strip().splitlines()) == 1
