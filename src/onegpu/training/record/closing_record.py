"""A training run's closing record, written on the way out, finished or not (rank 0 only): the outside
load over the training window (:mod:`onegpu.measure.outside_load`) and the run's figure
(:mod:`onegpu.training.record.figure`). Used by :mod:`onegpu.training.tracked_run` with its run handle."""
from __future__ import annotations

import contextlib
import json
import os
import signal
from collections.abc import Callable

from onegpu.errors import DiskFullError, one_line
from onegpu.measure import outside_load
from onegpu.training.lifecycle import interrupt
from onegpu.training.parallel import distributed
from onegpu.training.record import figure
from onegpu.training.record.run_tags import CONFIG_TAG, table_tags


def own_tree_root() -> int:
    """The pid whose process tree is this training's own: the launcher under a multi-process launch (its
    ranks are its children), else this process."""
    return os.getppid() if distributed.launched() else os.getpid()


@contextlib.contextmanager
def closing_record(tracker, run_id: str, rows: list, load: outside_load.Watch, title: str, figure_too: bool = True,
                   kept: Callable[[], int | None] | None = None):
    """On the way out, finished or not (rank 0 only): the outside load over the training window as the
    tag ``onegpu.outside_load`` and the metric ``train_outside_cpu_load`` (a line printed when the run
    was under load), and (``figure_too``) the run's figure (:mod:`onegpu.training.record.figure`) of the steps
    measured, under what happened (:func:`ending`) when the block raised. ``rows``: ``(optimizer step,
    metrics)`` pairs as the sink got them; ``title``: the figure's (the run's
    :func:`onegpu.training.record.run_tags.config_name`); ``kept``: the newest checkpoint's optimizer step, or None.
    Nothing here may hide the training's own error; a full disk fails a run that had not failed already."""
    error: BaseException | None = None
    try:
        yield
    except BaseException as e:
        error = e
        raise
    finally:
        if distributed.is_main():
            try:
                text = ending(error, kept() if kept else None) if error is not None else ""
                log_closing(tracker, run_id, rows, load.stop(), error is not None, title, figure_too, text)
            except DiskFullError as e:  # the run fails on it, unless it failed already (that error comes first)
                if error is None:
                    raise
                print(f"train: the run's figure was not logged: {e}")
            except Exception as e:  # a figure that cannot be drawn costs the figure only
                print(f"train: the run's figure or outside load was not logged ({type(e).__name__}: {e})")


def ending(error: BaseException, kept: int | None) -> str:
    """What happened to a run that did not finish and what to do, in one Markdown line for its description:
    the signal and step of a stop (KILLED) or the error's type and first line (FAILED), and the command that
    resumes it (:func:`onegpu.training.lifecycle.interrupt.resume_command`), from checkpoint ``kept`` when there is
    one."""
    cmd = interrupt.resume_command()
    if isinstance(error, KeyboardInterrupt):
        name = signal.Signals(getattr(error, "signum", signal.SIGINT)).name
        what = (f" after optimizer step {error.step}" if isinstance(error, interrupt.Interrupted)
                else f": {str(error).split(' stopped ', 1)[-1]}" if str(error) else "")
        start = f"from the checkpoint of optimizer step {kept}" if kept else "from the start (no checkpoint yet)"
        return f"**Stopped by {name}**{what} (KILLED). To resume: {cmd}, {start}."
    start = f"from the checkpoint of optimizer step {kept}" if kept else "from the start"
    return f"**Failed**: `{one_line(error, 100)}` (FAILED; tag `error.message`). Once fixed: {cmd}, {start}."


def log_closing(tracker, run_id: str, rows: list, load: dict | None, failed: bool, title: str,
                figure_too: bool = True, happened: str = "") -> None:
    """Log the outside load ``load`` (:meth:`onegpu.measure.outside_load.Watch.stop`'s dict; None:
    unmeasured) and (``figure_too``) the figure and its thumbnail of ``rows`` into ``run_id``, noting a
    ``failed`` (or stopped) run and a run under outside load on the figure; the run's description shows it,
    under ``happened`` (Markdown: what happened, :func:`ending`).

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
                                thumbnail=small, short=bool(happened))
        tracker.log_figure(run_id, fig, name)  # a Figure of its own (no pyplot): nothing to close
    tracker.set_tags(run_id, {figure.NOTE_TAG: figure.description(run_id, happened)})


def reaped_figure(tracker):
    """``on_reaped`` for :meth:`onegpu.tracking.Tracker.start_run`: a run marked KILLED because its process
    was killed outright (SIGKILL, the out-of-memory killer) gets the figure it could not draw itself, from
    the steps it logged, under its note. A run that has its figure already (its training finished) keeps it."""
    from onegpu import tracking

    def draw(run, note: str) -> None:
        if "get-artifact" in run.data.tags.get(figure.NOTE_TAG, ""):
            return
        series = tracking.metric_histories(tracker, run.info.run_id, tuple(p[0] for p in figure.PANELS))
        rows = [(step, {key: value}) for key, points in series.items() for step, value in points]
        title = run.data.tags.get(CONFIG_TAG) or run.info.run_name or ""
        log_closing(tracker, run.info.run_id, rows, None, True, title, happened=note)
    return draw
