"""The per-run figure: loss, gradient norm, peak memory and speed per optimizer step, one PNG that the
train stage logs as the run's artifact :data:`FIGURE` (MLflow's run page previews it under Artifacts)
and shows as the run's description (:func:`description`), on top of the run page's Overview tab. Drawn at the
end of training, and also when the training failed or was stopped, with the steps measured until then
(the title says so).
matplotlib's Agg backend; no MLflow here.
"""
from __future__ import annotations

FIGURE = "training_steps.png"
THUMBNAIL = "training_steps_small.png"  # the same, small enough for the run's description
FACE = "#fdf6e3"  # the figure's background: light, and a colour MLflow's UI never uses (the UI test finds it)
NOTE_TAG = "mlflow.note.content"  # the run's description, Markdown, on the top of MLflow's run Overview
# (metric, panel title, scale of the values, unit); memory in MiB, speed in examples per second.
PANELS = (("loss", "loss", 1.0, ""), ("grad_norm", "grad_norm", 1.0, ""),
          ("mem_peak_bytes", "memory", 1 / 2**20, "MiB"), ("samples_per_second", "speed", 1.0, "samples/s"))
REWARD_PANEL = ("reward", "reward", 1.0, "")  # first, for a run whose steps log a reward (GRPO's)
VALIDATION = {"loss": "eval_loss", "reward": "eval_reward"}  # a panel's validation points, where rows have them


def panels(rows: list[tuple[int, dict]]) -> tuple:
    """The figure's panels for the sink's ``rows``: :data:`PANELS`, after :data:`REWARD_PANEL` when they log one."""
    return (REWARD_PANEL, *PANELS) if series(rows, "reward")[0] else PANELS


def series(rows: list[tuple[int, dict]], metric: str) -> tuple[list[int], list[float]]:
    """The ``(steps, values)`` of ``metric`` in the sink's ``rows`` (``(optimizer step, metrics)``), by
    step; a step logged twice (a resumed run's replayed steps) keeps its last value; None values left out."""
    by_step = {s: m[metric] for s, m in rows if m.get(metric) is not None}
    steps = sorted(by_step)
    return steps, [float(by_step[s]) for s in steps]


def _last(metric: str, values: list[float], scale: float, unit: str) -> str:
    """The panel's headline: first -> last value (reward, loss, grad_norm), the peak (memory) or the mean (speed)."""
    if not values:
        return "not measured"
    if metric == "mem_peak_bytes":
        return f"peak {max(values) * scale:,.0f} {unit}"
    if metric == "samples_per_second":
        return f"mean {sum(values) / len(values):.3g} {unit}"
    return f"{values[0]:.4g} -> {values[-1]:.4g}"


def plot_steps(rows: list[tuple[int, dict]], title: str, note: str = "", thumbnail: bool = False,
               short: bool = False):
    """A strip of :func:`panels` side by side over the optimizer steps of ``rows``, each titled with its
    headline figure (first and last reward, loss and grad_norm, peak memory, mean speed), under ``title`` and
    ``note`` (e.g. ``stopped after 3 optimizer steps``, the outside load): 14 x 2.7 inches at 100 dpi. The loss
    and reward panels also draw the validation points (``eval_loss``, ``eval_reward``) where ``rows`` have them.
    ``thumbnail``: the same curves as sparklines (no axes' numbers), 825 x 78 pixels, without the title:
    MLflow's run description shows 100 px before "Show more", and an image at its own size
    (:func:`description`); ``short``: 54 pixels high, under a line of text in that description.
    Returns the figure (a ``matplotlib.figure.Figure`` of its own, no pyplot: the caller logs it); a panel
    without values says "not measured"."""
    from matplotlib.figure import Figure  # not pyplot: no backend or figure manager to import
    from matplotlib.ticker import MaxNLocator
    size, dpi, font = ((11, 0.72 if short else 1.04), 75, 9) if thumbnail else ((14, 2.7), 100, 10)
    fig = Figure(figsize=size, dpi=dpi, facecolor=FACE)
    shown = panels(rows)
    axes = fig.subplots(1, len(shown))
    for ax, (metric, label, scale, unit) in zip(axes, shown):
        steps, values = series(rows, metric)
        if steps:
            ax.plot(steps, [v * scale for v in values], marker="o" if len(steps) <= 40 else None,
                    markersize=3, linewidth=1.8)
        else:
            ax.text(0.5, 0.5, "not measured", ha="center", va="center", transform=ax.transAxes)
        heading = f"{label}: {_last(metric, values, scale, unit)}"
        if metric in VALIDATION and (evals := series(rows, VALIDATION[metric]))[0]:  # the validation points
            ax.plot(*evals, marker="s", markersize=4, linewidth=1.4, linestyle="--", label=VALIDATION[metric])
            heading += f"; eval {evals[1][-1]:.4g}"
            if not thumbnail:
                ax.legend(["training step", "validation"], fontsize=font - 2)
        ax.set_title(heading, fontsize=font)
        if not thumbnail:
            ax.set_xlabel("optimizer step", fontsize=9)
            ax.set_ylabel(unit or metric, fontsize=9)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.tick_params(labelsize=font - 2)
        if thumbnail:
            ax.set_xticks([])
            ax.set_yticks([])
        ax.grid(alpha=0.3)
    if not thumbnail:
        fig.suptitle(title + (f"; {note}" if note else ""), fontsize=10)
    fig.tight_layout(pad=0.4 if thumbnail else 1.08)
    return fig


def description(run_id: str, text: str = "") -> str:
    """The run's description (MLflow renders it as Markdown, HTML allowed): ``text`` (Markdown, e.g. why
    the run stopped and how to resume it) over the figure, through the MLflow server's ``get-artifact``
    address relative to the UI's page (any host and port): the thumbnail (78 px high: the description's
    first 100 px show it whole; MLflow drops an image's size attributes), linked to the full-size figure."""
    def src(name: str) -> str:
        return f"get-artifact?path={name}&amp;run_uuid={run_id}"
    image = (f'<a href="{src(FIGURE)}"><img src="{src(THUMBNAIL)}" '
             'alt="loss, grad_norm, memory and speed per optimizer step"></a>')
    return f"{text}\n\n{image}" if text else image
