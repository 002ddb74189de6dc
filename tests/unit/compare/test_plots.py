"""The compare plots as figures: every marker has a legend entry, equal curves stay visible, titles
name the splits (the key only as a short suffix), and no panel is empty."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from onegpu.compare import (  # noqa: E402
    INCOMPLETE,
    RunRecord,
    compare,
    plots,  # noqa: E402
)

KEY_A, KEY_B = "a1b2c3d4e5f60718a1b2c3d4", "b0b0b0b0b0b0b0b0b0b0b0b0"
LOSS = [(1, 1.6), (2, 1.4), (3, 1.1), (4, 0.9)]


def _run(name: str, key: str, micro: int, accum: int, loss=LOSS, sps: float = 10.0, mem: float = 2**30,
         start: int = 0) -> RunRecord:
    return RunRecord(run_id=name * 4, name=name, tags={"equivalence_key": key, "stage": "train"},
                     params={"resolved.per_device_train_batch_size": str(micro),
                             "resolved.gradient_accumulation_steps": str(accum),
                             "train.gradient_checkpointing": "False"},
                     metrics={"train_samples_per_second": sps, "train_mem_peak_bytes": mem},
                     series={"loss": list(loss)}, start_time=start, status="FINISHED")


def _comparison():
    # Group A: the reference and an identical run (equal values) plus one that stopped early;
    # group B: a single run (nothing to compare it with).
    return compare([_run("ref", KEY_A, 8, 1, sps=20.0, start=1),
                    _run("same", KEY_A, 4, 2, sps=20.0, start=2),          # same point as the reference
                    _run("short", KEY_A, 2, 4, loss=LOSS[:2], sps=5.0, start=3),
                    _run("alone", KEY_B, 4, 1, start=4)])


def test_loss_figure_keeps_equal_curves_visible_and_has_no_empty_panel():
    comparison = _comparison()
    fig = plots.loss_figure(comparison)
    try:
        axes = fig.axes
        # group A: loss + relative difference; group B (one run): one wide loss panel, no empty one
        assert len(axes) == 3
        assert all(ax.axison and (ax.lines or ax.collections) for ax in axes)
        loss_a = axes[0]
        markers = [ln.get_marker() for ln in loss_a.lines]
        sizes = [ln.get_markersize() for ln in loss_a.lines]
        assert len(set(markers)) == 3 and "None" not in markers  # each run its own marker
        assert sizes == sorted(sizes, reverse=True) and sizes[0] > sizes[-1]  # concentric when equal
        labels = [t.get_text() for t in loss_a.get_legend().get_texts()]
        assert any("4x2" in t and "identical" in t for t in labels)
        # every plotted line is in its panel's legend
        for ax in axes:
            legend = [t.get_text() for t in ax.get_legend().get_texts()]
            assert [ln.get_label() for ln in ax.lines] == legend
        # human titles: the splits, the key only as an 8-character suffix
        assert "8x1, 4x2, 2x4" in loss_a.get_title() and f"key {KEY_A[:8]})" in loss_a.get_title()
        assert all(KEY_A not in ax.get_title() and KEY_B not in ax.get_title() for ax in axes)
        assert "reference 8x1" in axes[1].get_title()
    finally:
        plt.close(fig)


def test_memory_figure_has_a_legend_entry_for_every_marker_and_labels_equal_points_once():
    comparison = _comparison()
    statuses = {c.status for g in comparison.groups for c in g.rows}
    assert INCOMPLETE in statuses  # a status whose marker had no legend entry before
    fig = plots.memory_figure(comparison)
    try:
        ax = fig.axes[0]
        legend = [t.get_text() for t in ax.get_legend().get_texts()]
        assert statuses <= set(legend)
        assert any("8x1, 4x2, 2x4" in t and KEY_A[:8] in t for t in legend)
        assert not any(KEY_A in t for t in legend)
        notes = [t.get_text() for t in ax.texts]
        assert "8x1 = 4x2" in notes  # the two runs at one point share one label
        assert len(ax.collections) == 4
    finally:
        plt.close(fig)


def test_memory_figure_draws_a_run_trained_under_outside_load_hollow_and_says_why():
    import json
    loaded = _run("loaded", KEY_A, 4, 2, sps=30.0, start=2)
    loaded.tags["onegpu.outside_load"] = json.dumps({"cpu_busy": 1.4, "cpus": 2, "share": 0.7})
    fig = plots.memory_figure(compare([_run("ref", KEY_A, 8, 1, sps=20.0, start=1), loaded]))
    try:
        ax = fig.axes[0]
        assert "4x2 (under outside load: speed not comparable)" in [t.get_text() for t in ax.texts]
        assert any("under outside load" in t.get_text() for t in ax.get_legend().get_texts())
        hollow = [c for c in ax.collections if not c.get_facecolor().any()]
        assert len(hollow) == 1
    finally:
        plt.close(fig)
