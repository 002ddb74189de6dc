"""A training run's closing record, written on the way out, finished or not (rank 0 only): the outside
load over the training window (:mod:`onegpu.measure.outside_load`) and the run's figure
(:mod:`onegpu.training.figure`). Used by :mod:`onegpu.training.tracked_run` with its run handle."""
from __future__ import annotations

import contextlib
import json
import os

from onegpu.errors import DiskFullError
from onegpu.measure import outside_load
from onegpu.training import distributed, figure
from onegpu.training.run_tags import table_tags


def own_tree_root() -> int:
    """The pid whose process tree is this training's own: the launcher under a multi-process launch (its
    ranks are its children), else this process."""
    return os.getppid() if distributed.launched() else os.getpid()


@contextlib.contextmanager
def closing_record(tracker, run_id: str, rows: list, load: outside_load.Watch, title: str, figure_too: bool = True):
    """On the way out, finished or not (rank 0 only): the outside load over the training window as the
    tag ``onegpu.outside_load`` and the metric ``train_outside_cpu_load`` (a line printed when the run
    was under load), and (``figure_too``) the run's figure (:mod:`onegpu.training.figure`) of the steps
    measured. ``rows``: ``(optimizer step, metrics)`` pairs as the sink got them; ``title``: the figure's
    (the run's :func:`onegpu.training.run_tags.config_name`). Nothing here may hide the training's own
    error; a full disk fails a run that had not failed already."""
    failed = True
    try:
        yield
        failed = False
    finally:
        if distributed.is_main():
            try:
                log_closing(tracker, run_id, rows, load.stop(), failed, title, figure_too)
            except DiskFullError as e:  # the run fails on it, unless it failed already (that error comes first)
                if not failed:
                    raise
                print(f"train: the run's figure was not logged: {e}")
            except Exception as e:  # a figure that cannot be drawn costs the figure only
                print(f"train: the run's figure or outside load was not logged ({type(e).__name__}: {e})")


def log_closing(tracker, run_id: str, rows: list, load: dict | None, failed: bool, title: str,
                figure_too: bool = True) -> None:
    """Log the outside load ``load`` (:meth:`onegpu.measure.outside_load.Watch.stop`'s dict; None:
    unmeasured) and (``figure_too``) the figure and its thumbnail of ``rows`` into ``run_id``, noting a
    ``failed`` (or stopped) run and a run under outside load on the figure; the run's description shows it.

    Raises:
        DiskFullError: an artifact could not be written for lack of space.
    """
    note = []
    if load is not None:
        tracker.set_tags(run_id, {outside_load.TAG: json.dumps(load), **table_tags({}, load)})
        tracker.log_metrics(run_id, {outside_load.METRIC: load["cpu_busy"]}, step=0)
        if outside_load.under_load(load):
            text = outside_load.describe(load)
            print(f"train: measured under outside load: {text} while it trained; its speed is not the "
                  "cost of its settings alone (train again on a quiet machine to time it)")
            note.append(f"under outside load: {text}")
    if not figure_too:
        return
    steps = len({s for s, _ in rows})
    if failed:
        note.insert(0, f"stopped or failed after {steps} logged optimizer step{'s' if steps != 1 else ''}")
    for name, small in ((figure.FIGURE, False), (figure.THUMBNAIL, True)):
        fig = figure.plot_steps(rows, f"{title} (MLflow run {run_id[:8]}): {steps} optimizer steps", "; ".join(note),
                                thumbnail=small)
        try:
            tracker.log_figure(run_id, fig, name)
        finally:
            import matplotlib.pyplot as plt  # heavy: only once a figure exists
            plt.close(fig)
    tracker.set_tags(run_id, {figure.NOTE_TAG: figure.description(run_id)})
