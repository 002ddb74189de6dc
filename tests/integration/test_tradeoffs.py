"""`onegpu tradeoffs` on a tiny project: `--full` rows as DVC experiments and probe rows in
worker processes, real MLflow runs, the report."""
from __future__ import annotations

import os

import pytest

from tests.integration.conftest import BIN, runs
from tests.tables import row

pytestmark = pytest.mark.slow


def test_full_rows_and_probe_rows_give_the_same_verdicts(tmp_path, monkeypatch, prepared):
    """`--full` (the whole job, evaluate too, as DVC experiments) and the probe window (2 optimizer steps of
    TINY's 3, up to train, in worker processes) give the split row the same verdict. With every
    same-training knob counted faster (MIN_GAIN -1, and outside load, which the suite's other workers make,
    ignored), the probe batch combines split, checkpointing and the host allocator and measures them
    together as `recommended`, which must be the same training as the baseline."""
    from onegpu import config
    from onegpu.stages import tradeoffs as stage
    from onegpu.tradeoffs import measurement as tradeoffs, recommend
    project = prepared(tmp_path / "p")
    monkeypatch.chdir(project)
    monkeypatch.setenv("PATH", f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.setattr(recommend, "MIN_GAIN", -1.0)
    monkeypatch.setattr(recommend, "load_reason", lambda row, baseline=None: "")  # the suite loads the machine
    cfg = config.load("params.yaml")
    full = {r.variant.name: r for r in stage.run(stage.Request(cfg, "params.yaml", ("split",), steps=None,
                                                               repeats=1, combine=False))}
    assert list(full) == ["baseline", "split-8x1"] and full["split-8x1"].verdict == tradeoffs.SAME_TRAINING
    for r in full.values():  # every optimizer step in MLflow, and evaluate ran
        assert [s for s, _ in r.run.series["loss"]] == [1, 2, 3] and "test_loss" in r.run.metrics \
            and "eval_loss" in r.run.metrics, r.variant.name  # --full: validation as the params say
    md = (project / "reports" / "tradeoffs.md").read_text()
    assert "The whole job: each row trains the job to its end and evaluates it (`--full`)." in md
    assert "Each row is a DVC experiment of its own" in md
    # The probe window; LoRA, checkpointing and the host allocator only here, for the suite's time.
    rows = stage.run(stage.Request(cfg, "params.yaml", ("split", "checkpointing", "allocator", "lora"), steps=2,
                                   repeats=1))
    by = {r.variant.name: r for r in rows}
    assert list(by) == ["baseline", "split-8x1", "checkpointing", "cpu-allocator-system", "lora", "recommended"]
    assert {n: r.verdict for n, r in by.items() if n in full} == {n: r.verdict for n, r in full.items()}
    assert [by[n].verdict for n in ("checkpointing", "cpu-allocator-system", "lora")] == [
        tradeoffs.SAME_TRAINING, tradeoffs.SAME_TRAINING, tradeoffs.DIFFERENT_TRAINING]
    assert by["lora"].memory_ratio < 0.5  # LoRA's breakdown is smaller
    for r in rows:
        assert [s for s, _ in r.run.series["loss"]] == [1, 2] and "test_loss" not in r.run.metrics, r.variant.name
        assert "eval_loss" not in r.run.metrics, r.variant.name  # the probe window validates nothing
    rec = by["recommended"]
    assert rec.run is not None and rec.verdict == tradeoffs.SAME_TRAINING
    assert dict(rec.variant.overrides) == {"train.per_device_train_batch_size": "8",
                                           "train.gradient_accumulation_steps": "1",
                                           "train.gradient_checkpointing": "true", "train.cpu_allocator": "system"}
    assert rec.run.params["train.gradient_checkpointing"] == "True" and rec.run.tags["cpu_allocator"] == "system"
    assert rec.run.micro_batch == 8 and rec.run.accumulation == 1
    # A worker's row is the train stage's training: the probe baseline's two steps are the first two of
    # the full baseline's (trained by `dvc exp run` from data/processed), to the bit (the linear schedule
    # gives the first update the same rate in a 2- and a 3-step window).
    for key in ("loss", "grad_norm"):
        assert by["baseline"].run.series[key] == full["baseline"].run.series[key][:2], key
    # The host allocator is process-wide: the system row had a worker of its own. It changes where memory
    # comes from, not one bit of the training.
    assert by["baseline"].run.tags["cpu_allocator"].startswith("caching (glibc mallopt")
    assert by["cpu-allocator-system"].run.tags["cpu_allocator"] == "system"
    for key in ("loss", "grad_norm"):
        assert by["cpu-allocator-system"].run.series[key] == by["baseline"].run.series[key], key
    md = (project / "reports" / "tradeoffs.md").read_text()
    assert "Incomplete" not in md and "rows in worker processes, one at a time" in md
    assert row(md, "recommended") and "verdict against the baseline: **same training**" in md
    c, exp, all_runs = runs(project)
    report_runs = sorted((r for r in all_runs if r.data.tags.get("stage") == "tradeoffs"),
                         key=lambda r: r.info.start_time)
    assert len(report_runs) == 2
    rr = report_runs[-1]
    assert {a.path for a in c.list_artifacts(rr.info.run_id)} == {"tradeoffs.md", "tradeoffs.png"}
    assert rr.data.metrics["recommended_speedup"] == pytest.approx(rec.speedup)
