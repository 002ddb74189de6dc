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
    ``*hang*`` waits for SIGINT and replies as a stopped row does (so does getting ready for a row with
    ``train.x=hang``). Each message it gets is a line of ``events``: ``ready <pid>``, ``train <name> <pid>``."""
    while True:
        spec = conn.recv()
        if spec is None:
            return
        with open("events", "a") as f:  # the worker inherits the test's own folder
            f.write(f"{'ready' if spec.get('prepare') else 'train ' + spec['name']} {os.getpid()}\n")
        if spec.get("prepare"):
            if "train.x=hang" in spec["overrides"]:
                try:
                    open("hang.started", "w").close()
                    time.sleep(60)
                except KeyboardInterrupt:
                    conn.send({"name": None, "returncode": None, "seconds": 0.0})
                    return
            conn.send({"name": None, "returncode": 0, "seconds": 0.0})
            continue
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
        # both workers made ready first, then each row in order
        assert [k for k, _ in seen] == ["caching", "system", "caching", "system", "caching", "caching", "caching"]
        assert pids[0] == pids[2] == pids[4] == pids[5] != pids[1] == pids[3]  # one worker per setting, once
        assert pids[6] != pids[5]  # the dead worker's next row got a new one
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


def test_every_worker_the_rows_need_is_ready_before_the_first_row(tmp_path, monkeypatch, capsys):
    """The workers start at once and each gets its rows' data ready before any row trains, so that no row's
    wall time holds a worker's start; a later round finds them ready and asks nothing again."""
    monkeypatch.chdir(tmp_path)
    rows = [BASE, _variant("split", "split"), _variant("alloc", "allocator",
                                                      overrides=(("train.cpu_allocator", "system"),))]
    with workers.Pool("params.yaml", _group, offline=True, target=stand_in) as pool:
        pool.ask([[]])  # the baseline's worker, asked while the command plans: not asked again below
        workers.run_rows(pool, "b-", rows, [])
        first = pool.ready_s
        workers.run_rows(pool, "b2-", rows, [])
        assert pool.ready_s == first  # nothing new to get ready
    events = [line.split() for line in (tmp_path / "events").read_text().splitlines()]
    assert [e[0] for e in events[:2]] == ["ready", "ready"] and events[0][1] != events[1][1]
    assert [e[1] for e in events[2:]] == ["b-baseline", "b-split", "b-alloc", "b2-baseline", "b2-split", "b2-alloc"]
    # the host allocator's row in the other worker made ready (the two get ready in either order)
    assert events[4][2] != events[2][2] and {events[2][2], events[4][2]} == {events[0][1], events[1][1]}


def test_sigterm_while_the_workers_get_ready_starts_no_row(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rows = [_variant("hangs-ready", "split", overrides=(("train.x", "hang"),)), _variant("never", "split")]
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with workers.Pool("params.yaml", _group, offline=True, target=stand_in) as pool:
            threading.Thread(target=_sigterm_once_hang_started, daemon=True).start()
            ran, interrupted = workers.run_rows(pool, "b-", rows, [])
            assert interrupted and ran == [] and pool._workers == {}
    finally:
        signal.signal(signal.SIGINT, old)
    assert "train" not in (tmp_path / "events").read_text()


def test_a_worker_still_getting_ready_when_the_command_ends_is_killed_at_once(tmp_path, monkeypatch):
    """A command that refuses its rows while the baseline's worker gets ready (Pool.ask) exits without
    waiting for it: that worker has no run open."""
    monkeypatch.chdir(tmp_path)
    with workers.Pool("params.yaml", _group, offline=True, target=stand_in) as pool:
        pool.ask([["train.x=hang"]])
        _wait_for("hang.started")
        (p, _), = pool._workers.values()
        t0 = time.monotonic()
    assert time.monotonic() - t0 < 5 and not p.is_alive() and pool._workers == {}


def _wait_for(path: str, limit_s: float = 60.0) -> None:
    t0 = time.monotonic()
    while not os.path.exists(path) and time.monotonic() - t0 < limit_s:
        time.sleep(0.05)
