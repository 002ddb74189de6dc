"""A run's closing record (onegpu.training.record.closing_record): the outside load as tag, metric and table tag,
the figure and its thumbnail with the run's description, and what a failure or a full disk does."""
from __future__ import annotations

import json

import pytest

from onegpu.errors import DiskFullError
from onegpu.measure import outside_load
from onegpu.training.record import closing_record, figure

LOAD = {"cpu_busy": 1.42, "cpus": 2, "share": 0.71, "loadavg": [3.1, 4.0], "window_s": 60.0}
ROWS = [(1, {"loss": 1.5, "grad_norm": 2.0, "mem_peak_bytes": 2e8, "samples_per_second": 40.0}),
        (2, {"loss": 1.0, "grad_norm": 1.0, "mem_peak_bytes": 2e8, "samples_per_second": 41.0})]


class Tracker:
    """Records what is logged, as a run handle would write it."""

    def __init__(self, full_disk: bool = False):
        self.tags, self.metrics, self.figures, self.full_disk = {}, {}, [], full_disk

    def set_tags(self, run_id, tags):
        self.tags.update(tags)

    def log_metrics(self, run_id, metrics, step=None):
        self.metrics.update(metrics)

    def log_figure(self, run_id, fig, name):
        if self.full_disk:
            raise DiskFullError(f"no space left on the device writing {name}")
        self.figures.append((name, fig))


def test_the_closing_record_logs_the_outside_load_and_the_figure_of_a_finished_run(capsys):
    tracker = Tracker()
    closing_record.log_closing(tracker, "abcdef0123", ROWS, LOAD, failed=False, title="bs4x2-fp32")
    assert json.loads(tracker.tags[outside_load.TAG]) == LOAD and tracker.metrics == {outside_load.METRIC: 1.42}
    assert tracker.tags["outside_load"] == "71% of 2 CPUs"
    assert [name for name, _ in tracker.figures] == [figure.FIGURE, figure.THUMBNAIL]
    assert tracker.tags[figure.NOTE_TAG] == figure.description("abcdef0123")
    assert "train: measured under outside load: " in capsys.readouterr().out  # 71% is above the threshold


def test_a_probe_row_gets_the_outside_load_but_no_figure():
    tracker = Tracker()
    closing_record.log_closing(tracker, "r", ROWS, None, failed=True, title="t", figure_too=False)
    assert tracker.figures == [] and tracker.tags == {} and tracker.metrics == {}


def test_a_full_disk_fails_a_finished_run_but_never_hides_the_trainings_own_error(capsys):
    class Watch:
        def stop(self):
            return None

    with pytest.raises(DiskFullError):
        with closing_record.closing_record(Tracker(full_disk=True), "r", ROWS, Watch(), "t"):
            pass
    with pytest.raises(RuntimeError, match="the training's own"):
        with closing_record.closing_record(Tracker(full_disk=True), "r", ROWS, Watch(), "t"):
            raise RuntimeError("the training's own")
    assert "train: the run's figure was not logged: no space left" in capsys.readouterr().out


def test_a_stopped_or_failed_run_says_what_happened_and_how_to_resume_over_its_figure(monkeypatch):
    import signal

    from onegpu.training.lifecycle import interrupt
    monkeypatch.setenv("DVC_STAGE", "train")
    monkeypatch.setenv("MAKELEVEL", "1")
    monkeypatch.delenv("DVC_EXP_NAME", raising=False)
    stop = closing_record.ending(interrupt.Interrupted(signal.SIGINT, 3), kept=3)
    assert stop == ("**Stopped by SIGINT** after optimizer step 3 (KILLED). To resume: `make run` again "
                    "(`dvc repro`), from the checkpoint of optimizer step 3.")
    abandoned = closing_record.ending(interrupt.stopped_by(signal.SIGTERM, "the run before its training began"), None)
    assert abandoned.startswith("**Stopped by SIGTERM**: the run before its training began (KILLED). To resume: ")
    assert abandoned.endswith(", from the start (no checkpoint yet).")
    monkeypatch.delenv("MAKELEVEL")
    failed = closing_record.ending(RuntimeError("CUDA error: an illegal memory access\nmore lines"), kept=20)
    assert failed == ("**Failed**: `RuntimeError: CUDA error: an illegal memory access` (FAILED; tag "
                      "`error.message`). Once fixed: `dvc repro`, from the checkpoint of optimizer step 20.")

    class Watch:
        def stop(self):
            return None

    tracker = Tracker()
    with pytest.raises(interrupt.Interrupted):
        with closing_record.closing_record(tracker, "abcdef0123", ROWS, Watch(), "t", kept=lambda: 2):
            raise interrupt.Interrupted(signal.SIGINT, 2)
    note = tracker.tags[figure.NOTE_TAG]
    assert note == closing_record.ending(interrupt.Interrupted(signal.SIGINT, 2), 2) + "\n\n" + figure.description(
        "abcdef0123")
    assert [name for name, _ in tracker.figures] == [figure.FIGURE, figure.THUMBNAIL]


def test_a_run_killed_outright_gets_the_figure_of_the_steps_it_logged_under_its_note():
    from types import SimpleNamespace as NS

    history = {"loss": [NS(step=1, value=1.5, timestamp=1), NS(step=2, value=1.0, timestamp=2)],
               "grad_norm": [NS(step=1, value=2.0, timestamp=1)]}
    tracker = Tracker()
    tracker.client = NS(get_metric_history=lambda run_id, key: history.get(key, []))
    run = NS(info=NS(run_id="abcdef0123", run_name="bs4x2"), data=NS(tags={"config": "bs4x2-fp32"}))
    closing_record.reaped_figure(tracker)(run, "**Killed outright** (KILLED): gone")
    assert [name for name, _ in tracker.figures] == [figure.FIGURE, figure.THUMBNAIL]
    assert tracker.tags[figure.NOTE_TAG] == "**Killed outright** (KILLED): gone\n\n" + figure.description("abcdef0123")
    title = tracker.figures[0][1]._suptitle.get_text()
    assert title.startswith("bs4x2-fp32 (MLflow run abcdef01): 2 optimizer steps; stopped or failed after 2")
    finished = NS(info=run.info, data=NS(tags={figure.NOTE_TAG: figure.description("abcdef0123")}))
    tracker.figures.clear()
    closing_record.reaped_figure(tracker)(finished, "note")  # its training had drawn its figure: kept
    assert tracker.figures == []
