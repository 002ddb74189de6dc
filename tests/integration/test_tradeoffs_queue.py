"""`onegpu tradeoffs --queue-only` then `--report` on a tiny project: real DVC queue, real MLflow runs (a file
of its own: it holds a test worker for minutes, beside test_tradeoffs.py's)."""
from __future__ import annotations

import pytest

from tests.integration.conftest import BIN, dvc, run, runs, wait_for_queue
from tests.tables import row

pytestmark = pytest.mark.slow


def _training_runs(project, prefix):
    _, _, all_runs = runs(project)
    return {r.info.run_name.removeprefix(prefix): r for r in all_runs
            if r.data.tags.get("stage") == "train" and (r.info.run_name or "").startswith(prefix)}


def test_queue_only_then_report(tmp_path, prepared):
    """Queued probe rows (the user's -S train.max_steps=2 is the window): up to train, no evaluate."""
    project = prepared(tmp_path / "p")
    out = run([str(BIN / "onegpu"), "tradeoffs", "--queue-only", "--knobs", "precision",
               "-S", "train.max_steps=2"], project).stdout
    assert "queued tradeoffs-" in out and "next: dvc queue start -j 1" in out
    batch = out.split("; batch ")[1].split(")")[0]
    status = dvc(project, "queue", "status").stdout
    assert f"tradeoffs-{batch}-baseline" in status and f"tradeoffs-{batch}-bf16" in status
    dvc(project, "queue", "start", "-j", "1")
    wait_for_queue(project)
    out = run([str(BIN / "onegpu"), "tradeoffs", "--report"], project).stdout
    assert "same within bf16 tolerance" in out, out
    md = (project / "reports" / "tradeoffs.md").read_text()
    assert f"# onegpu tradeoffs {batch} -S train.max_steps=2" in md and row(md, "bf16") and row(md, "baseline")
    trained = _training_runs(project, f"tradeoffs-{batch}-")
    assert sorted(trained) == ["baseline", "bf16"]
    c, _, _ = runs(project)
    for r in trained.values():  # -S reached every experiment, the baseline too; evaluate did not run
        assert r.info.status == "SCHEDULED" and "test_loss" not in r.data.metrics
        assert [m.step for m in c.get_metric_history(r.info.run_id, "loss")] == [1, 2]
    assert "probe window: each row trains its first 2 optimizer steps" in md
    # Bad input: one line, exit 2, nothing queued.
    p = run([str(BIN / "onegpu"), "tradeoffs", "--knobs", "split,turbo"], project, check=False)
    assert p.returncode == 2 and p.stderr.strip().count("\n") == 0
    assert "unknown turbo; choose from split,checkpointing" in p.stderr
    assert "Queued" not in dvc(project, "queue", "status").stdout
