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


def test_an_incomplete_batch_says_so_and_recommends_nothing(tmp_path):
    """1 of 3 rows measured (issue 20: 'keep your params' and 'not run' for rows stopped with
    `dvc queue stop --kill`, 'within the no memory budget set'): incomplete, each missing row's word."""
    killed = _run("split-16x1", step_time=0.5)
    killed.status = "KILLED"
    variants = [BASE, _variant("split-16x1", "split"), _variant("attn-eager", "attention")]
    rows = measurement.measure_rows(variants, {"baseline": _run("baseline"), "split-16x1": killed})
    rec = recommend.recommend(rows, None)
    md, _ = tradeoffs_report.write(rows, rec, None, tmp_path, "t")
    text = md.read_text()
    assert ("**Incomplete: 1 of 3 rows measured**: no recommendation (it would rest on the rows that happened "
            "to run). Missing: split-16x1 (stopped), attn-eager (not run).") in text
    assert "Recommendation" not in text and "keep your params" not in text and "budget" not in text
    assert row(text, "split-16x1")[-1] == "stopped" and row(text, "attn-eager")[-1] == "not run"
    assert "Incomplete: 1 of 3 rows measured" in tradeoffs_report.terminal(rows, rec, None)


def test_the_recommendation_names_a_budget_only_when_there_is_one():
    rows = measurement.measure_rows([BASE, _variant("attn-eager", "attention")],
                                    {"baseline": _run("baseline"), "attn-eager": _run("attn-eager", step_time=1.0)})
    none = " ".join(tradeoffs_report.recommendation_lines(recommend.recommend(rows, None), None, rows))
    assert "keep your params" in none and "budget" not in none, none
    some = " ".join(tradeoffs_report.recommendation_lines(recommend.recommend(rows, 2 * 2**30), None, rows))
    assert "faster within the memory budget 2.00 GiB." in some, some


def test_a_combination_its_repeats_do_not_confirm_is_not_recommended():
    """Two knobs clearly faster alone; together, in three repeats, inside the baseline's spread."""
    from tests.unit.tradeoffs.test_recommend import _repeats
    runs = {**_repeats("baseline", [1.0, 1.08, 0.95]), **_repeats("split-16x1", [0.7, 0.75, 0.66]),
            **_repeats("attn-eager", [0.8, 0.85, 0.76])}
    variants = [BASE, _variant("split-16x1", "split", overrides=(("train.a", "1"),)),
                _variant("attn-eager", "attention", overrides=(("train.b", "1"),))]
    rows = measurement.measure_rows(variants, runs, repeats=3)
    rec = recommend.recommend(rows, None)
    assert rec.variant.name == "recommended"
    together = {**runs, **_repeats("recommended", [0.96, 1.1, 0.9])}  # 1.04x, 0.98x, 1.06x
    from onegpu.tradeoffs import batch
    measured = batch._combined(rec.variant, together, 3, {})
    lines = " ".join(tradeoffs_report.recommendation_lines(rec, measured, rows))
    assert lines.startswith("**Recommendation:** keep your params. Together (split-16x1 + attn-eager) the faster "
                            "knobs measured 1.04x, 0.98x-1.06x over 3 repeats the baseline's samples/s, verdict "
                            "**same training**: no clear difference"), lines
    assert "dvc exp run" not in lines
    stopped = batch._combined(rec.variant, runs, 3, {"recommended": "Stopped"})  # Ctrl-C in its first repeat
    lines = " ".join(tradeoffs_report.recommendation_lines(rec, stopped, rows))
    assert lines.startswith("**No recommendation yet:** the knobs that were clearly faster alone (split-16x1 "
                            "1.44x, attn-eager 1.25x) have not been measured together (stopped)"), lines
    assert " ".join(tradeoffs_report.recommendation_lines(rec, None, rows)).startswith(  # --no-combine
        "**No recommendation yet:**")
    confirmed = batch._combined(rec.variant, {**runs, **_repeats("recommended", [0.6, 0.66, 0.58])}, 3, {})
    assert "`dvc exp run -S 'train.a=1' -S 'train.b=1'`" in " ".join(
        tradeoffs_report.recommendation_lines(rec, confirmed, rows))
