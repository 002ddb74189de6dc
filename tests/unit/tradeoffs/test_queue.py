"""The DVC queue driver (onegpu.tradeoffs.queue)."""
from __future__ import annotations



def test_run_queue_waits_for_its_experiments_to_leave_the_queue(monkeypatch, capsys):
    """`dvc exp run --run-all` can return at once while a worker left from an earlier call runs the task
    just queued: the report then found no run for it (seen: the combined recommendation 'not run')."""
    from onegpu.tradeoffs import queue
    states = [["tradeoffs-1-recommended", "other"], ["tradeoffs-1-recommended"], []]
    monkeypatch.setattr(queue, "in_queue", lambda: states.pop(0))
    monkeypatch.setattr(queue.subprocess, "run", lambda *a, **k: None)  # run-all returns at once
    monkeypatch.setattr(queue.time, "sleep", lambda s: None)
    queue.run_all({"tradeoffs-1-recommended"})
    assert states == []  # polled until its experiment left the queue
    assert "waiting for tradeoffs-1-recommended (still in the DVC queue)" in capsys.readouterr().out
