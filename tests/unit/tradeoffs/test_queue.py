"""The DVC driver (onegpu.tradeoffs.queue): rows one at a time with progress, Ctrl-C stopping its own row."""
from __future__ import annotations

import signal

from onegpu.tradeoffs import queue, rows as one_at_a_time
from tests.unit.tradeoffs.runs import BASE, _variant


class _FakeDvc:
    """``subprocess.Popen`` of ``dvc exp run --temp``: each row takes 10 s of the fake clock; the row
    named ``interrupt_at`` gets Ctrl-C while it runs."""
    started: list[list[str]] = []
    signals: list[int] = []

    end_rc = 130  # how the interrupted row's dvc ends after our SIGINT (0: it had finished its training)

    def __init__(self, cmd, interrupt_at, clock):
        self.cmd, self.interrupt, self.clock, self.done, self.waited = cmd, interrupt_at in cmd[5], clock, False, False
        self.args, self.returncode = cmd, None
        _FakeDvc.started.append(cmd)

    def wait(self, timeout=None):
        if self.interrupt and not self.waited:
            self.waited = True
            raise KeyboardInterrupt()
        if self.interrupt and timeout == 10.0 and not self.signals:  # it does not end at the terminal's Ctrl-C
            raise queue.subprocess.TimeoutExpired(self.cmd, timeout)
        self.clock[0] += 10.0
        self.done = True
        self.returncode = self.end_rc if self.interrupt else 0
        return self.returncode

    def poll(self):
        return 0 if self.done else None

    def send_signal(self, s):
        _FakeDvc.signals.append(s)

    def kill(self):
        _FakeDvc.signals.append(signal.SIGKILL)


def test_rows_run_one_at_a_time_with_progress_and_ctrl_c_stops_only_its_own_row(monkeypatch, capsys):
    clock = [0.0]
    _FakeDvc.started, _FakeDvc.signals = [], []
    monkeypatch.setattr(queue.subprocess, "Popen", lambda cmd: _FakeDvc(cmd, "p-attn-eager", clock))
    monkeypatch.setattr(one_at_a_time.time, "monotonic", lambda: clock[0])
    rows = [BASE, _variant("split-16x1", "split"), _variant("attn-eager", "attention"), _variant("compile", "compile")]
    ran, interrupted = queue.run_rows("p-", rows, ["train"], force={"baseline"})
    assert interrupted and [(r.name, r.returncode) for r in ran] == [("p-baseline", 0), ("p-split-16x1", 0),
                                                                     ("p-attn-eager", None)]
    assert len(_FakeDvc.started) == 3  # compile never started
    assert _FakeDvc.started[0][:7] == [queue.dvc(), "exp", "run", "--temp", "--name", "p-baseline", "--force"]
    assert _FakeDvc.started[1][-3:] == ["-S", "train.x=1", "train"] and "--force" not in _FakeDvc.started[1]
    assert _FakeDvc.signals == [signal.SIGINT]  # not ended 10 s after Ctrl-C: told once more, then it ended
    out = capsys.readouterr().out
    assert "row 1 of 4: p-baseline  (your params)  (time left: known after the first row)" in out
    assert "row 2 of 4: p-split-16x1  -S 'train.x=1'  (about 30 s left)" in out
    assert "row 3 of 4" in out and "row 4 of 4" not in out
    assert signal.getsignal(signal.SIGTERM) is not one_at_a_time._raise_terminated  # SIGTERM's handler put back


def test_a_row_that_finishes_while_it_is_being_stopped_counts_as_finished(monkeypatch):
    """SIGTERM arrived, the row ended 0 within the grace: it is a finished row, the next one never starts."""
    clock = [0.0]
    _FakeDvc.started, _FakeDvc.signals, _FakeDvc.end_rc = [], [], 0
    monkeypatch.setattr(queue.subprocess, "Popen", lambda cmd: _FakeDvc(cmd, "p-baseline", clock))
    try:
        ran, interrupted = queue.run_rows("p-", [BASE, _variant("compile", "compile")], ["train"])
    finally:
        _FakeDvc.end_rc = 130
    assert interrupted and [(r.name, r.returncode) for r in ran] == [("p-baseline", 0)]
