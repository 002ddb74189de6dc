"""The comparison's two PNG plots: loss curves with their differences from the reference, and memory
against throughput. matplotlib's Agg backend (no display needed); input is a
:class:`onegpu.compare.groups.Comparison`."""
from __future__ import annotations

import math
from pathlib import Path

from onegpu.compare.groups import Comparison, GroupComparison
from onegpu.compare.verdict import DIVERGED, EQUIVALENT, INCOMPLETE, NO_DATA, REFERENCE
from onegpu.formatting import MiB

LOSS_PLOT = "loss_curves.png"
MEMORY_PLOT = "memory_vs_throughput.png"
MAX_PLOTTED_GROUPS = 6  # the most recent groups get a loss panel; the report lists all of them


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


# One marker per run of a group, drawn hollow and smaller for each later run: runs with equal values
# show as concentric markers instead of one line hiding another.
RUN_MARKERS = ("o", "s", "D", "^", "v", "P", "X", "<", ">", "h")
STATUS_MARKERS = {REFERENCE: "*", EQUIVALENT: "o", DIVERGED: "X", INCOMPLETE: "s", NO_DATA: "d"}


def _run_style(i: int) -> dict:
    """Matplotlib style of the ``i``-th run of a group: its marker, hollow, shrinking with ``i``."""
    return {"marker": RUN_MARKERS[i % len(RUN_MARKERS)], "markersize": max(11 - 2 * i, 4),
            "markerfacecolor": "none", "markeredgewidth": 1.4,
            "linewidth": max(2.6 - 0.5 * i, 1.0), "linestyle": ("-", "--", "-.", ":")[i % 4]}


def _same_as_reference(c) -> bool:
    return not c.is_reference and c.loss.common_steps > 0 and c.loss.max_abs == 0


def _splits(g: GroupComparison) -> str:
    return ", ".join(c.run.split for c in g.rows)


FLOOR = 1e-10  # relative differences of 0 are drawn here on the log scale


def _loss_panel(ax, g: GroupComparison) -> None:
    """Every run's loss per optimizer step, overlaid."""
    from matplotlib.ticker import MaxNLocator
    for i, c in enumerate(g.rows):
        s = c.run.series.get("loss", [])
        if not s:
            continue
        steps, values = zip(*s)
        note = " reference" if c.is_reference else (" = reference (identical)" if _same_as_reference(c)
                                                    else f" {c.verdict}")
        ax.plot(steps, values, label=f"{c.run.split} ({c.run.label}){note}", zorder=2 + i, **_run_style(i))
    ax.set_title(f"Loss per optimizer step: {_splits(g)}  (key {g.key[:8]})", fontsize=10)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)


def _difference_panel(dax, g: GroupComparison) -> None:
    """Each run's relative loss difference from the reference (log scale, floor :data:`FLOOR`), with the
    precision's tolerance."""
    from matplotlib.ticker import MaxNLocator
    dax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ref = dict(g.reference.series.get("loss", []))
    for i, c in enumerate(g.rows):
        if c.is_reference:
            continue
        pts = [(st, abs(v - ref[st]) / abs(ref[st]) if ref[st] else abs(v - ref[st]))
               for st, v in c.run.series.get("loss", []) if st in ref and not (math.isnan(v) or math.isnan(ref[st]))]
        if pts:
            xs, ys = zip(*pts)
            zero = " (identical: drawn at the floor)" if not any(ys) else ""
            dax.plot(xs, [max(y, FLOOR) for y in ys], label=f"{c.run.split} {c.verdict}{zero}", zorder=2 + i,
                     **_run_style(i))
    tol = g.rows[1].tolerance
    dax.set_yscale("log")
    dax.axhline(tol.rtol, color="red", linewidth=1, linestyle=":",
                label=f"tolerance {tol.rtol:g} ({g.rows[1].precision})")
    dax.set_ylim(bottom=FLOOR / 2)
    dax.set_title(f"Relative loss difference from the reference {g.reference.split}  (key {g.key[:8]})",
                  fontsize=10)
    dax.set_xlabel("optimizer step")
    dax.set_ylabel(f"|loss - ref| / |ref| (floor {FLOOR:g})")
    dax.legend(fontsize=8)
    dax.grid(alpha=0.3, which="both")


def loss_figure(comparison: Comparison):
    """The figure of :func:`plot_loss_curves` (a matplotlib ``Figure``; the caller closes it)."""
    plt = pyplot()
    groups = comparison.groups[:MAX_PLOTTED_GROUPS]
    fig = plt.figure(figsize=(12, 3.8 * max(len(groups), 1)))
    grid = fig.add_gridspec(max(len(groups), 1), 2)
    if not groups:  # onegpu compare stops before this; a direct call still gets a readable picture
        ax = fig.add_subplot(grid[0, :])
        ax.text(0.5, 0.5, "no training runs to plot", ha="center", va="center")
        ax.set_axis_off()
    for row, g in enumerate(groups):
        compared = len(g.rows) > 1
        _loss_panel(fig.add_subplot(grid[row, 0] if compared else grid[row, :]), g)
        if compared:
            _difference_panel(fig.add_subplot(grid[row, 1]), g)
    fig.tight_layout()
    return fig


def plot_loss_curves(comparison: Comparison, path: str | Path) -> Path:
    """PNG: per group (at most :data:`MAX_PLOTTED_GROUPS`, newest first), the loss per optimizer step of
    every run overlaid (left) and, when the group has more than one run, each run's relative loss
    difference from the reference on a log scale with the precision's tolerance (right). Each run has
    its own hollow marker, smaller for each later run, so equal values show as concentric markers;
    a run identical to the reference says so in the legend. Titles name the splits and the key's
    first 8 characters."""
    fig = loss_figure(comparison)
    path = Path(path)
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    return path


def memory_figure(comparison: Comparison):
    """The figure of :func:`plot_memory_vs_throughput` (a matplotlib ``Figure``; the caller closes it)."""
    plt = pyplot()
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    fig, ax = plt.subplots(figsize=(8, 5.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    handles, statuses, labels_at, overlapped = [], [], {}, False
    for i, g in enumerate(comparison.groups):
        color = colors[i % len(colors)]
        shown = False
        for c in g.rows:
            x, y = c.run.samples_per_second, c.run.peak_memory_bytes
            if x is None or y is None:
                continue
            alone = c.speed_comparable  # overlapped or under outside load: hollow marker, the reason in the label
            overlapped = overlapped or not alone
            ax.scatter([x], [y / MiB], color=color if alone else "none", marker=STATUS_MARKERS.get(c.status, "d"),
                       s=180 if c.is_reference else 70, edgecolors="black" if alone else color,
                       linewidths=0.5 if alone else 1.5, zorder=3, alpha=0.85)
            # Runs at the same point share one label instead of printing over each other.
            labels_at.setdefault((round(x, 3), round(y / MiB, 1)), []).append(
                c.run.split + ("" if alone else " (overlapped: not comparable)" if c.overlaps else
                               " (under outside load: speed not comparable)"))
            if c.status not in statuses:
                statuses.append(c.status)
            shown = True
        if shown:
            handles.append(Patch(color=color, label=f"{_splits(g)}  (key {g.key[:8]})"))
    for (x, y), names in labels_at.items():
        ax.annotate(" = ".join(names) if len(names) > 1 else names[0], (x, y), textcoords="offset points",
                    xytext=(7, 6), fontsize=8)
    handles += [Line2D([], [], linestyle="none", marker=STATUS_MARKERS.get(st, "d"), markerfacecolor="white",
                       markeredgecolor="black", markersize=9, label=st) for st in statuses]
    if overlapped:
        handles.append(Line2D([], [], linestyle="none", marker="o", markerfacecolor="none", markeredgecolor="grey",
                              markersize=9, label="hollow: trained alongside another run or under outside load "
                              "(speed not comparable)"))
    if not labels_at:
        ax.text(0.5, 0.5, "no run has both peak memory and throughput", ha="center", va="center",
                transform=ax.transAxes)
    ax.set_xlabel("training throughput (samples per second)")
    ax.set_ylabel("peak memory during training (MiB)")
    ax.set_title("Memory against throughput, one point per run (micro-batch x accumulation)")
    ax.grid(alpha=0.3)
    ax.margins(0.15)
    if handles:
        ax.legend(handles=handles, fontsize=8, loc="best")
    fig.tight_layout()
    return fig


def plot_memory_vs_throughput(comparison: Comparison, path: str | Path) -> Path:
    """PNG: one point per run, training throughput (samples per second) against peak memory (MiB),
    labelled ``micro x accumulation`` (+ ``ckpt``; runs at the same point share one label joined by
    ``=``); colour = group (legend: its splits and key), marker = verdict (legend: the verdicts shown)."""
    fig = memory_figure(comparison)
    path = Path(path)
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    return path
