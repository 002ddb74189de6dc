"""The probe rows' workers (onegpu.tradeoffs.pool): real spawned processes with a stand-in for the worker's
loop (no training): rows go to the worker of their process-wide setting, a dead worker fails only its
row, SIGTERM stops exactly the row running and ends its worker."""
from __future__ import annotations

import os
import signal
import threading
import time

from onegpu.tradeoffs import pool as workers
from tests.unit.tradeoffs.runs import BASE, _variant


def stand_in(conn, offline: bool) -> None:
    """A worker that 'trains' a row by replying with its pid; a row named ``*die*`` kills the worker,
    ``*hang*`` waits for SIGINT and replies as a stopped row does."""
    while True:
        spec = conn.recv()
        if spec is None:
            return
        if "die" in spec["name"]:
            os._exit(9)
        if "hang" in spec["name"]:
            try:
                open("hang.started", "w").close()  # the worker inherits the test's own folder
                time.sleep(60)
            except KeyboardInterrupt:
                conn.send({"name": spec["name"], "returncode": None, "seconds": 0.0})
                return
        conn.send({"name": spec["name"], "returncode": 0, "seconds": 0.0, "pid": os.getpid(),
                   "overrides": spec["overrides"]})


def _group(overrides: list[str]) -> str:
    return "system" if "train.cpu_allocator=system" in overrides else "caching"


def test_rows_share_the_worker_of_their_setting_and_a_dead_worker_fails_only_its_row(capsys):
    rows = [BASE, _variant("alloc", "allocator", overrides=(("train.cpu_allocator", "system"),)),
            _variant("split", "split"), _variant("die", "split"), _variant("after", "split")]
    with workers.Pool("params.yaml", _group, offline=True, target=stand_in) as pool:
        seen = []
        real = pool._worker

        def spy(key):
            p, conn = real(key)
            seen.append((key, p.pid))
            return p, conn
        pool._worker = spy
        ran, interrupted = workers.run_rows(pool, "b-", rows, ["train.max_steps=2"])
        assert not interrupted
        assert [(r.name, r.returncode) for r in ran] == [("b-baseline", 0), ("b-alloc", 0), ("b-split", 0),
                                                         ("b-die", 9), ("b-after", 0)]
        pids = [pid for _, pid in seen]
        assert [k for k, _ in seen] == ["caching", "system", "caching", "caching", "caching"]
        assert pids[0] == pids[2] == pids[3] != pids[1]  # one worker per setting, started once
        assert pids[4] != pids[3]  # the dead worker's next row got a new one
        assert len(pool._workers) == 2
        procs = [p for p, _ in pool._workers.values()]
    assert all(not p.is_alive() and p.exitcode == 0 for p in procs)  # closed: each ended its loop
    out = capsys.readouterr().out
    assert "row 1 of 5: b-baseline  (your params)  (time left: known after the first row)" in out
    assert "row 5 of 5: b-after" in out


def _sigterm_once_hang_started(limit_s: float = 120.0) -> None:
    t0 = time.monotonic()
    while not os.path.exists("hang.started") and time.monotonic() - t0 < limit_s:
        time.sleep(0.1)
    os.kill(os.getpid(), signal.SIGTERM)


def test_sigterm_stops_the_row_running_and_no_later_row_starts():
    """SIGTERM (to this process alone) while a row trains: its worker gets SIGINT and ends the row, even
    when this process was started with SIGINT ignored (a shell's background job, a pytest-xdist worker:
    the worker inherits that), and no later row starts."""
    rows = [BASE, _variant("hang", "split"), _variant("never", "split")]
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with workers.Pool("params.yaml", _group, offline=True, target=stand_in) as pool:
            threading.Thread(target=_sigterm_once_hang_started, daemon=True).start()
            ran, interrupted = workers.run_rows(pool, "b-", rows, [])
            t_stopped = time.monotonic()
            assert interrupted and [(r.name, r.returncode) for r in ran] == [("b-baseline", 0), ("b-hang", None)]
            assert ran[1].seconds < 30  # the worker got our SIGINT; nobody waited out its sleep or the grace
            assert pool._workers == {}  # the stopped worker is gone; nothing else was started
        assert time.monotonic() - t_stopped < 5
    finally:
        signal.signal(signal.SIGINT, old)
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
