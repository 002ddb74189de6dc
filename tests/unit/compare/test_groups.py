"""The runs of one equivalence key together (onegpu.compare.groups): the reference, the group's rows and
summary, runs that trained at the same time."""
from __future__ import annotations

import pytest

from onegpu import compare as eq
from tests.tables import row
from tests.unit.compare.records import KEY, drifted, record, windowed


def test_reference_is_largest_micro_batch_then_no_checkpointing_then_earliest():
    runs = [record("small", 4, 16, start=1), record("big-ckpt", 64, 1, ckpt=True, start=2),
            record("big-late", 64, 1, start=5), record("big-early", 64, 1, start=3)]
    assert eq.choose_reference(runs).name == "big-early"
    assert eq.choose_reference(runs[:3]).name == "big-late"
    assert eq.choose_reference(runs[:2]).name == "big-ckpt"
    # a run without any per-step loss is not chosen while another has one
    empty = record("empty", 128, 1)
    empty.series = {}
    assert eq.choose_reference([empty, runs[0]]).name == "small"


def test_compare_groups_by_key_with_trade_offs_and_summary():
    runs = [record("ref", 64, 1, start=1, mem=4e9, sps=100, evals={"test_loss": 0.5, "test_accuracy": 0.90}),
            record("split", 4, 16, start=2, mem=1e9, sps=60, evals={"test_loss": 0.5, "test_accuracy": 0.90}),
            record("ckpt", 64, 1, ckpt=True, start=3, mem=2e9, sps=80,
                   evals={"test_loss": 0.51, "test_accuracy": 0.92}),
            record("drop", 8, 8, dropout=0.1, loss=drifted(3), start=4),
            record("alone", 16, 1, key="fedcba9876543210", start=0)]
    nokey = record("old", 8, 1)
    nokey.tags.pop("equivalence_key")
    result = eq.compare(runs + [nokey])
    assert [r.name for r in result.skipped] == ["old"]
    assert [g.key for g in result.groups] == [KEY, "fedcba9876543210"]  # groups that compare first
    g = result.groups[0]
    assert g.reference.name == "ref" and g.rows[0].is_reference
    by = {c.run.name: c for c in g.rows}
    assert by["split"].memory_ratio == pytest.approx(0.25)
    assert by["split"].throughput_ratio == pytest.approx(0.6)
    assert by["ckpt"].eval_deltas["test_accuracy"] == pytest.approx(0.02)
    assert by["ckpt"].eval_deltas["test_loss"] == pytest.approx(0.01)
    assert by["split"].run.mean_step_time_s == pytest.approx(64 / 60)
    assert by["drop"].verdict == "diverged at step 3"
    assert g.count(eq.EQUIVALENT) == 2 and g.count(eq.DIVERGED) == 1
    assert "2 of 3 equivalent" in g.summary and "1 diverged: drop at step 3, likely cause: dropout" in g.summary
    assert "least memory: 4x16" in g.summary
    assert "Nothing to compare" in result.groups[1].summary


def test_runs_that_trained_at_the_same_time_have_no_comparable_speed():
    """Issue 9 case 6: with `dvc queue start -j 2` 4x4 ckpt looked faster than 4x4 without (0.42x vs
    0.31x of the reference): the two shared the cores. Their speed and memory are marked, not ranked."""
    ref = windowed("ref", 16, 1, 0, 100, sps=100.0)
    a = windowed("a-ckpt", 4, 4, 200, 400, ckpt=True, sps=42.0, mem=5e8)
    b = windowed("b", 4, 4, 250, 420, sps=31.0, mem=6e8)
    late = windowed("late", 8, 2, 500, 600, sps=120.0)
    elsewhere = windowed("elsewhere", 2, 8, 200, 400, machine="m2", sps=20.0)
    cmp = eq.compare([ref, a, b, late, elsewhere])
    rows = {c.run.name: c for c in cmp.groups[0].rows}
    assert rows["a-ckpt"].overlaps == ["b"] and rows["b"].overlaps == ["a-ckpt"]
    assert rows["ref"].cost_comparable and rows["late"].cost_comparable and rows["elsewhere"].cost_comparable
    summary = cmp.groups[0].summary
    assert "Speed and memory not comparable for b, a-ckpt" in summary
    assert "the fastest: 8x2" in summary  # 120 samples/s
    assert "4x4" not in summary.split("Among")[1]  # a-ckpt's 477 MiB is not ranked "least memory"
    from onegpu.compare import report
    md = report.markdown(cmp, images=())
    assert {"42.0*", "0.42x*", "477*"} <= set(row(md, "a-ckpt"))
    assert "a-ckpt trained at the same time as b" in md and "dvc queue start -j 1" in md
    assert not any("*" in cell for cell in row(md, "late"))
    term = report.terminal_table(cmp)
    assert "42.0*" in term and "not comparable" in term and "120.0*" not in term


def test_an_overlap_with_a_run_outside_the_selection_counts():
    ref = windowed("ref", 16, 1, 0, 100)
    other_key = windowed("sweep", 16, 1, 50, 150, key="ffffffffffffffff")
    cmp = eq.compare([ref], others=[other_key])
    assert cmp.groups[0].rows[0].overlaps == ["sweep"]
    # A touch of less than a second is not an overlap (a queue's next run starting as one ends).
    assert eq.find_overlaps([windowed("x", 1, 1, 0, 10)], [windowed("y", 1, 1, 9.5, 20)]) == {}


def test_runs_named_together_across_keys_are_one_group_and_another_learning_rate_diverges_with_its_cause():
    """``onegpu compare --exp A B C``: a run of another equivalence key (another learning rate, planted:
    its training and validation curves leave the reference's from step 2 on) is compared with the
    others, diverged, its cause the key's differing param; unnamed, it stays a group of its own."""
    from tests.unit.compare.records import _with
    ref = _with(record("16x1", 16, 1), **{"train.learning_rate": 1e-4})
    split = _with(record("4x4", 4, 4), **{"train.learning_rate": 1e-4})
    lr = _with(record("lr", 16, 1, key="fedcba9876543210", loss=drifted(2)), **{"train.learning_rate": 2e-4})
    for r, off in ((ref, 0.0), (split, 1e-8), (lr, 5e-2)):
        r.series["eval_loss"] = [(4, 1.2 * (1 + off)), (8, 1.0 * (1 + off))]
    assert len(eq.compare([ref, split, lr]).groups) == 2  # by key
    [group] = eq.compare([ref, split, lr], named=True).groups
    assert group.key == f"{KEY[:8]}+fedcba98" and group.reference is ref
    verdicts = {c.run.name: c for c in group.rows}
    assert verdicts["4x4"].verdict == "equivalent"
    assert verdicts["lr"].verdict == "diverged at step 2"
    assert "validation curve: 2 common point(s), largest relative difference 0.05; diverged at validation step 4 " \
           "(its first)" in verdicts["lr"].notes
    assert verdicts["lr"].causes[0] == ("train.learning_rate 0.0002 vs 0.0001 differs: another training (another "
                                        "equivalence key, compared because the runs were named together)")
    assert "lr at step 2, likely cause: train.learning_rate 0.0002 vs 0.0001 differs." in group.summary


def test_a_stopped_run_is_left_out_where_the_run_that_resumed_it_is_compared_with_its_own_split_noted():
    """A run stopped after step 3 at 8 x 8 and resumed at 4 x 16 (the same training, another split): the resumed
    run carries steps 1-3 as the stopped one measured them, so the stopped run is left out (compared, the two
    would be "equal" on steps measured once, and the 8 x 8 run, the larger micro-batch, would be the reference);
    the resumed run's row says which steps the other split trained. Without the resume in the set, both compared."""
    stopped = record("stopped", 8, 8, loss=[(s, v) for s, v in drifted(99)[:3]], start=1)
    stopped.params["resolved.world_size"] = "2"
    stopped.status = "KILLED"
    resumed = record("resumed", 4, 16, start=2)
    ref = record("whole", 2, 32, start=0)
    stopped.tags["onegpu.resumed_by"] = resumed.run_id
    resumed.tags.update({"onegpu.resumed_from": stopped.run_id, "onegpu.resumed_at_step": "3"})
    c = eq.compare([ref, stopped, resumed])
    (g,) = c.groups
    assert [r.name for r in g.runs] == ["resumed", "whole"] and [r.name for r in c.continued] == ["stopped"]
    (note,) = [n for n in g.rows[0].notes if n.startswith("steps 1-")]
    assert note == ("steps 1-3 are run stopped's, trained at 8 x 8 on 2 process(es); it resumed them, and its own "
                    "split applies from the next step")
    assert not any(n.startswith("steps 1-") for n in g.rows[1].notes)
    from onegpu.compare import report
    assert report.continued_line(c) == ("1 stopped run(s) left out, their steps being the first of the run that "
                                        "resumed them: stopped (resumed by resumed).")
    assert [r.name for r in eq.compare([ref, stopped]).groups[0].runs] == ["stopped", "whole"]
