"""tradeoffs.md, tradeoffs.png and the terminal table (onegpu.tradeoffs.report)."""
from __future__ import annotations

from onegpu.tradeoffs import measurement, recommend, report as tradeoffs_report
from tests.tables import row
from tests.unit.tradeoffs.runs import BASE, _run, _variant


def test_report_markdown_terminal_and_plot(tmp_path):
    base = _run("baseline")
    runs = {"baseline": base, "split-16x1": _run("split-16x1", step_time=0.7),
            "attn-eager": _run("attn-eager", step_time=0.8)}
    variants = [BASE, _variant("split-16x1", "split", overrides=(("train.per_device_train_batch_size", "16"),)),
                _variant("attn-eager", "attention", overrides=(("model.attn_implementation", "eager"),))]
    rows = measurement.measure_rows(variants, runs)
    rec = recommend.recommend(rows, None)
    measured = measurement.measure_row(rec.variant, _run("recommended", step_time=0.6), base)
    for r in rows[1:]:
        r.notes.append("optimizer step 6 saw 4 of 16 examples")
    rows[1].notes.append("run status KILLED")
    md, png = tradeoffs_report.write(rows, rec, measured, tmp_path, "t", skipped=["tf32: a no-op on CPU"])
    text = md.read_text()
    # a note every row shares is said once; a row's own note stays with its row
    assert text.count("saw 4 of 16") == 1 and "- every row: optimizer step 6 saw 4 of 16 examples" in text
    assert "- split-16x1: run status KILLED" in text
    assert row(text, "split-16x1")[0] == "split-16x1" and row(text, "recommended")[0] == "recommended"
    assert ("`dvc exp run -S 'train.per_device_train_batch_size=16' -S 'model.attn_implementation=eager'`"
            in text)
    assert "Measured: 1.67x the baseline's samples/s (26.67 vs 16.00)" in text
    assert "not measured: tf32: a no-op on CPU" in text
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    term = tradeoffs_report.terminal(rows, rec, measured)
    assert "split-16x1" in term and "1.43x" in term and "same training" in term
