"""`onegpu tradeoffs` on a tiny project: `--full` rows as DVC experiments and probe rows in
worker processes, real MLflow runs, the report."""
from __future__ import annotations

import os

import pytest

from tests.integration.conftest import BIN, runs
from tests.tables import row

pytestmark = pytest.mark.slow


def test_full_rows_and_probe_rows_give_the_same_verdicts(tmp_path, monkeypatch, prepared):
    """`--full` (the whole job, evaluate too, time to the baseline's eval loss) and the probe window
    (2 optimizer steps of TINY's 3, up to train) give the split row the same verdict. With every same-training
    knob counted faster (MIN_GAIN -1, and outside load, which the suite's other workers make, ignored), the full batch combines split and checkpointing and measures
    them together as `recommended`, which must be the same training as the baseline."""
    from onegpu import config
    from onegpu.stages import tradeoffs as stage
    from onegpu.tradeoffs import measurement as tradeoffs, recommend
    project = prepared(tmp_path / "p")
    monkeypatch.chdir(project)
    monkeypatch.setenv("PATH", f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.setattr(recommend, "MIN_GAIN", -1.0)
    monkeypatch.setattr(recommend, "load_reason", lambda row, baseline=None: "")  # the suite loads the machine
    cfg = config.load("params.yaml")
    rows = stage.run(cfg, "params.yaml", ("split", "checkpointing"), steps=None, repeats=1)
    names = [r.variant.name for r in rows]
    assert names == ["baseline", "split-8x1", "checkpointing", "recommended"]
    by = {r.variant.name: r for r in rows}
    assert by["split-8x1"].verdict == tradeoffs.SAME_TRAINING
    assert by["checkpointing"].verdict == tradeoffs.SAME_TRAINING
    rec = by["recommended"]
    assert rec.run is not None and rec.verdict == tradeoffs.SAME_TRAINING
    assert dict(rec.variant.overrides) == {"train.per_device_train_batch_size": "8",
                                           "train.gradient_accumulation_steps": "1",
                                           "train.gradient_checkpointing": "true"}
    assert rec.run.params["train.gradient_checkpointing"] == "True"
    assert rec.run.micro_batch == 8 and rec.run.accumulation == 1
    # Every row's per-step loss is in MLflow for all optimizer steps.
    for r in rows:
        assert [s for s, _ in r.run.series["loss"]] == [1, 2, 3], r.variant.name
        assert "eval_loss" in r.run.metrics
    md = (project / "reports" / "tradeoffs.md").read_text()
    assert row(md, "recommended") and "verdict against the baseline: **same training**" in md
    assert "The whole job: each row trains the job to its end and evaluates it (`--full`)." in md
    c, exp, all_runs = runs(project)
    report_runs = [r for r in all_runs if r.data.tags.get("stage") == "tradeoffs"]
    assert len(report_runs) == 1
    rr = report_runs[0]
    assert {a.path for a in c.list_artifacts(rr.info.run_id)} == {"tradeoffs.md", "tradeoffs.png"}
    assert rr.data.metrics["recommended_speedup"] == pytest.approx(rec.speedup)
    # The probe window, its rows in worker processes on data prepared in memory: the same verdict for
    # the split; LoRA and the host allocator (not in the full batch, for the suite's time).
    probe = [r for r in stage.run(cfg, "params.yaml", ("split", "allocator", "lora"), steps=2, repeats=1,
                                  combine=False) if r.variant.knob != "recommended"]
    verdicts = {r.variant.name: r.verdict for r in probe}
    assert verdicts == {"baseline": by["baseline"].verdict, "split-8x1": by["split-8x1"].verdict,
                        "cpu-allocator-system": tradeoffs.SAME_TRAINING, "lora": tradeoffs.DIFFERENT_TRAINING}
    pb = {r.variant.name: r for r in probe}
    assert pb["lora"].memory_ratio < 0.5  # LoRA's breakdown is smaller
    for r in probe:
        assert [s for s, _ in r.run.series["loss"]] == [1, 2] and "eval_loss" not in r.run.metrics, r.variant.name
    # A worker's row is the train stage's training: the probe baseline's two steps are the first two of
    # the full baseline's (trained by `dvc exp run` from data/processed), to the bit (the linear schedule
    # gives the first update the same rate in a 2- and a 3-step window).
    for key in ("loss", "grad_norm"):
        assert pb["baseline"].run.series[key] == by["baseline"].run.series[key][:2], key
    # The host allocator is process-wide: the system row had a worker of its own. It changes where memory
    # comes from, not one bit of the training.
    assert pb["baseline"].run.tags["cpu_allocator"].startswith("caching (glibc mallopt")
    assert pb["cpu-allocator-system"].run.tags["cpu_allocator"] == "system"
    for key in ("loss", "grad_norm"):
        assert pb["cpu-allocator-system"].run.series[key] == pb["baseline"].run.series[key], key
    md = (project / "reports" / "tradeoffs.md").read_text()
    assert "Incomplete" not in md and "rows in worker processes, one at a time" in md

