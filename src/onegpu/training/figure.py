"""The per-run figure: loss, gradient norm, peak memory and speed per optimizer step, one PNG that the
train stage logs as the run's artifact :data:`FIGURE` (MLflow's run page previews it under Artifacts)
and shows as the run's description (:func:`description`), on top of the run page's Overview tab. Drawn at the end of training, and also when the
training failed or was stopped, with the steps measured until then (the title says so).
matplotlib's Agg backend; no MLflow here.
"""
from __future__ import annotations

FIGURE = "training_steps.png"
NOTE_TAG = "mlflow.note.content"  # the run's description, Markdown, on the top of MLflow's run Overview
# (metric, panel title, scale of the values, unit); memory in MiB, speed in examples per second.
PANELS = (("loss", "loss (effective batch)", 1.0, ""), ("grad_norm", "grad_norm (before clipping)", 1.0, ""),
          ("mem_peak_bytes", "peak memory per step", 1 / 2**20, "MiB"),
          ("samples_per_second", "speed per step", 1.0, "samples/s"))


def series(rows: list[tuple[int, dict]], metric: str) -> tuple[list[int], list[float]]:
    """The ``(steps, values)`` of ``metric`` in the sink's ``rows`` (``(optimizer step, metrics)``), by
    step; a step logged twice (a resumed run's replayed steps) keeps its last value; None values left out."""
    by_step = {s: m[metric] for s, m in rows if m.get(metric) is not None}
    steps = sorted(by_step)
    return steps, [float(by_step[s]) for s in steps]


def plot_steps(rows: list[tuple[int, dict]], title: str, note: str = ""):
    """A 2 x 2 matplotlib figure of :data:`PANELS` over the optimizer steps of ``rows``; ``note``: a line
    under the title (e.g. ``stopped after 3 optimizer steps``, the outside load). Returns the figure
    (the caller logs and closes it); a panel without values says "not measured"."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(2, 2, figsize=(10, 6.4), sharex=True)
    for ax, (metric, label, scale, unit) in zip(axes.flat, PANELS):
        steps, values = series(rows, metric)
        if steps:
            ax.plot(steps, [v * scale for v in values], marker="o" if len(steps) <= 40 else None,
                    markersize=3, linewidth=1.5)
        else:
            ax.text(0.5, 0.5, "not measured", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(label, fontsize=10)
        ax.set_ylabel(unit or metric)
        ax.grid(alpha=0.3)
    from matplotlib.ticker import MaxNLocator
    for ax in axes[1]:
        ax.set_xlabel("optimizer step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.suptitle(title + (f"\n{note}" if note else ""), fontsize=11)
    fig.tight_layout()
    return fig


def description(run_id: str, note: str = "") -> str:
    """The run's description (Markdown): the figure, through the MLflow server's ``get-artifact`` address
    relative to the UI's page (so it works on any host and port), then ``note``."""
    text = f"![loss, grad_norm, memory and speed per optimizer step](get-artifact?path={FIGURE}&run_uuid={run_id})"
    return text + (f"\n\n{note}" if note else "")
