"""report.py: the Markdown report (sections, tolerance table, overlap marks, partial-step notes) and the
terminal table, on hand-made records with known values."""
from __future__ import annotations

import pytest

from onegpu import compare as eq
from onegpu.compare import report
from tests.tables import cells, row as _row

KEY, SOLO = "abcdef0123456789", "ffff000011112222"


def _record(name: str, micro: int, accum: int, start: int, loss: list[float], ckpt: bool = False,
            window: tuple[int, int] | None = None, mem: float = 1e9, sps: float = 100.0,
            tags: dict | None = None) -> eq.RunRecord:
    t = {"equivalence_key": KEY, "device": "cpu", **(tags or {})}
    if window:
        t.update({"onegpu.train_start_ms": str(window[0]), "onegpu.train_end_ms": str(window[1])})
    return eq.RunRecord(
        run_id=name.ljust(32, "0"), name=name, start_time=start, tags=t,
        params={"resolved.per_device_train_batch_size": str(micro), "resolved.gradient_accumulation_steps": str(accum),
                "resolved.effective_batch_size": str(micro * accum), "train.gradient_checkpointing": str(ckpt),
                "train.bf16": "False", "train.fp16": "False", "train.backend": "trainer"},
        metrics={"train_mem_peak_bytes": mem, "train_samples_per_second": sps, "test_loss": 1.0 + start / 100},
        series={"loss": list(enumerate(loss, 1)), "grad_norm": [(s, 1.0) for s in range(1, len(loss) + 1)],
                "step_time_s": [(1, 0.5), (2, 0.7)]})


@pytest.fixture
def comparison() -> eq.Comparison:
    """Group KEY: ref 8x1 and split 4x2 trained at the same time (windows overlap 5 s), ckpt 8x1 alone and
    equal, bad 2x4 with dropout diverging at step 2; group SOLO: one run whose step 1 saw 10 of 16
    examples; one run without a key."""
    base = [2.0, 1.5, 1.2]
    runs = [_record("ref", 8, 1, 1, base, window=(0, 10_000)),
            _record("split", 4, 2, 2, [2.0, 1.5000001, 1.2], window=(5_000, 20_000), mem=5e8, sps=80.0),
            _record("ckpt", 8, 1, 3, base, ckpt=True),
            _record("bad", 2, 4, 4, [2.0, 1.6, 1.3], tags={"model.dropout_max": "0.1"}),
            eq.RunRecord(run_id="solo".ljust(32, "1"), name="solo", start_time=9, tags={"equivalence_key": SOLO},
                         params={"resolved.per_device_train_batch_size": "8",
                                 "resolved.gradient_accumulation_steps": "2", "resolved.effective_batch_size": "16"},
                         series={"loss": [(1, 1.0)], "step_examples": [(1, 10)]}),
            eq.RunRecord(run_id="nokey".ljust(32, "2"), name="nokey")]
    return eq.compare(runs)



def test_markdown_sections_in_order(comparison):
    md = report.markdown(comparison, "onegpu", "sqlite:///x.db")
    assert md.startswith("# Equivalence and trade-offs of training runs\n")
    assert ("5 training runs in MLflow experiment `onegpu`, in 2 groups of equal `equivalence_key` "
            "(store `sqlite:///x.db`).") in md
    assert "1 run(s) without an `equivalence_key` tag were left out: nokey." in md
    heads = [line for line in md.splitlines() if line.startswith("## ")]
    assert heads == ['## What "equivalent" means here', f"## Group 1: `{KEY}`", f"## Group 2: `{SOLO}`", "## Plots"]
    assert _row(md, "1")[:5] == ["1", f"`{KEY}`", "4", "2", "1"]
    assert _row(md, "1")[5].startswith("4 runs; reference ref (8x1, fp32).")
    assert _row(md, "2")[:5] == ["2", f"`{SOLO}`", "1", "0", "0"]
    assert _row(md, "2")[5].startswith("1 run; reference solo (8x2, fp32).")
    assert "Effective batch 8 examples per optimizer step, fp32, device cpu." in md
    assert md.rstrip().endswith("![loss curves](loss_curves.png)\n![memory vs throughput](memory_vs_throughput.png)")
    assert "## Plots" not in report.markdown(comparison, images=())


def test_markdown_group_rows_hold_the_differences_and_costs(comparison):
    md = report.markdown(comparison, images=())
    assert _row(md, "ckpt (") == ["ckpt (`ckpt0000`)", "8 x 1", "yes", "fp32", "3", "equivalent", "0", "0", "0",
                                  "0", "+0.0200", "954", "1.00x*", "100.0", "1.00x*", "0.600"]
    assert _row(md, "bad (")[:11] == ["bad (`bad00000`)", "2 x 4", "no", "fp32", "3", "**diverged at step 2**",
                                      "1.00e-01", "8.33e-02", "0", "0", "+0.0300"]
    assert ("- **bad** (2x4) diverged at step 2: loss differs by 1.00e-01 at most (step 2), grad_norm by 0 "
            "relative at most; tolerances 0.0001 (loss) and 0.001 (grad_norm) relative (fp32).") in md
    assert "  - likely cause: dropout (p up to 0.1) with a different micro-batch (2 vs 8)" in md


def test_tolerance_table_lists_every_precision():
    lines = report.tolerance_table().splitlines()
    assert cells(lines[0]) == ["precision", "eps", "loss rtol / atol", "grad_norm rtol / atol", "basis"]
    assert set(lines[1]) == {"|", "-"}  # the rule under the header
    assert [cells(line)[:4] for line in lines[2:]] == [
        ["fp32", "1.19e-07", "0.0001 / 1e-06", "0.001 / 1e-06"],
        ["tf32", "0.000977", "0.002 / 1e-05", "0.01 / 1e-05"],
        ["bf16", "0.00781", "0.01 / 0.0001", "0.05 / 0.0001"],
        ["fp16", "0.000977", "0.01 / 0.0001", "0.05 / 0.0001"]]


def test_overlapped_runs_are_marked_in_markdown(comparison):
    md = report.markdown(comparison, images=())
    assert _row(md, "ref (")[-5:] == ["954*", "1.00x*", "100.0*", "1.00x*", "0.600*"]
    assert _row(md, "split (")[-5:] == ["477*", "0.50x*", "80.0*", "0.80x*", "0.600*"]
    # ckpt trained alone: its own values unmarked, its ratios marked (the reference overlapped)
    assert _row(md, "ckpt (")[-5:] == ["954", "1.00x*", "100.0", "1.00x*", "0.600"]
    assert ("* not comparable: ref trained at the same time as split; split trained at the same time as ref. "
            "Time splits one run at a time (`dvc queue start -j 1`) on a quiet machine.") in md


def test_partial_step_is_noted(comparison):
    md = report.markdown(comparison, images=())
    assert ("- solo: optimizer step 1 saw 10 of 16 examples (an epoch's short last step): its loss and "
            "gradient are over those only") in md
    assert "Step 1 saw fewer examples than the effective batch" in _row(md, "2")[5]


def test_terminal_table(comparison):
    text = report.terminal_table(comparison, summaries=False)
    lines = text.splitlines()
    assert lines[0] == f"group 1 key {KEY} (4 runs, 2 equivalent, 1 diverged)"
    assert lines[1].split() == ["run", "micro", "x", "accum", "ckpt", "verdict", "max", "|d", "loss|", "peak", "MiB",
                                "samples/s"]
    assert set(lines[2]) == {" ", "-"} and lines[2].startswith("  -")  # a dash rule per column, indented
    assert lines[3].split() == ["ref", "8", "x", "1", "no", "reference", "-", "954*", "100.0*"]
    # the numbers are right-aligned: each ends where its column's header ends
    for name in ("max |d loss|", "peak MiB", "samples/s"):
        end = lines[1].index(name) + len(name)
        assert all(line[end - 1] != " " for line in lines[3:6]), name
    assert ["split", "4", "x", "2", "no", "equivalent", "1.00e-07", "477*", "80.0*"] in [ln.split() for ln in lines]
    assert ["bad", "2", "x", "4", "no", "diverged", "at", "step", "2", "1.00e-01", "954", "100.0"] in [
        ln.split() for ln in lines]
    assert ("* not comparable: ref trained at the same time as split; split trained at the same time as ref; "
            "time one run at a time (dvc queue start -j 1) on a quiet machine") in " ".join(ln.strip() for ln in lines)
    assert f"group 2 key {SOLO} (1 run, 0 equivalent, 0 diverged)" in lines
    assert "4 runs; reference" not in text
    wrapped = report.terminal_table(comparison, width=60)
    assert "  4 runs; reference ref (8x1, fp32). 2 of 3 equivalent to it" in wrapped.splitlines()
    table_lines = ("group", "  run", "  --", "  ref", "  ckpt", "  split", "  bad", "  solo")
    assert all(len(line) <= 60 for line in wrapped.splitlines() if not line.startswith(table_lines))


def _loaded(name, micro, accum, share: float, sps: float):
    import json

    from tests.unit.compare.records import record
    r = record(name, micro, accum, sps=sps)
    r.tags["onegpu.outside_load"] = json.dumps({"cpu_busy": 2 * share, "cpus": 2, "share": share,
                                                "loadavg": [12.0, 12.5], "window_s": 60.0})
    return r


def test_a_run_trained_under_outside_load_has_its_speed_marked_with_the_figure_and_is_never_the_fastest():
    """Issue 20 item 3: 16x1 at 2.5 samples/s against 4x4 at 0.7, both under load 12, were shown as the
    splits' costs. Speed (not memory: the process's own) is marked, the figures named, no fastest claimed."""
    runs = [_loaded("big", 16, 1, 0.71, sps=2.5), _loaded("small", 4, 4, 0.05, sps=0.7)]
    c = eq.compare(runs)
    md = report.markdown(c, images=())
    assert _row(md, "big (")[-5:] == ["954", "1.00x", "2.5*", "1.00x*", "25.600*"]
    assert _row(md, "small (")[-5:] == ["954", "1.00x", "0.7", "0.28x*", "91.429"]
    assert ("* not comparable: big trained under outside load (other processes used 1.42 of 2 CPUs (71%), "
            "load average 12.0 -> 12.5)") in md
    assert "- big: trained under outside load (other processes used 1.42 of 2 CPUs" in md
    summary = c.groups[0].summary
    assert "Speed not comparable for big (under outside load: other processes used 1.42 of 2 CPUs" in summary
    assert "the fastest" not in summary and "no fastest" in summary
    text = " ".join(ln.strip() for ln in report.terminal_table(c, summaries=False).splitlines())
    assert "2.5*" in text and "0.7*" not in text and "big trained under outside load" in text
