"""onegpu.interpreter: the `onegpu` command's garbage-collector settings, CPython's own while it trains."""
from __future__ import annotations

import gc
import subprocess
import sys

from onegpu import cli, interpreter


def test_start_raises_the_young_threshold_and_settle_freezes_and_restores_cpythons(collector):
    gc.set_threshold(*interpreter.DEFAULT_THRESHOLD)
    gc.unfreeze()
    interpreter.start()
    assert gc.get_threshold() == interpreter.START_THRESHOLD == (10_000, *interpreter.DEFAULT_THRESHOLD[1:])
    assert gc.get_freeze_count() == 0
    interpreter.settle()
    assert gc.get_threshold() == interpreter.DEFAULT_THRESHOLD
    frozen = gc.get_freeze_count()
    assert frozen > 1000  # the modules this process imported, at least
    garbage = [[] for _ in range(100)]  # new objects: a second settle must not freeze them
    interpreter.settle()
    assert gc.get_freeze_count() == frozen and garbage


def test_settle_without_start_leaves_the_interpreter_as_it_is(collector):
    gc.unfreeze()
    gc.set_threshold(700, 10, 10)
    interpreter.settle()  # a library caller's training (a notebook, these tests, bench/)
    assert gc.get_threshold() == (700, 10, 10) and gc.get_freeze_count() == 0


def test_the_command_starts_tuned_and_main_alone_does_not(collector, monkeypatch):
    seen = []
    monkeypatch.setattr(cli, "main", lambda argv=None: seen.append(gc.get_threshold()) or 0)
    gc.set_threshold(700, 10, 10)
    assert cli.entry() == 0 and seen == [interpreter.START_THRESHOLD]


def test_python_m_onegpu_runs_tuned_and_freezes_at_exit_with_the_commands_exit_code(tmp_path):
    """`python -m onegpu` (how a launch starts its ranks) goes through the same entry; a hook registered
    before it sees, at exit, the start-up threshold (no training settled it) and the objects frozen."""
    code = ("import atexit, gc, runpy, sys; "
            "atexit.register(lambda: print('at exit', gc.get_threshold()[0], gc.get_freeze_count() > 0)); "
            "sys.argv = ['onegpu', 'summary', '--params', 'missing.yaml']; runpy.run_module('onegpu', run_name='__main__')")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert p.returncode == 2 and "onegpu summary: error:" in p.stderr, p.stderr
    assert p.stdout.splitlines()[-1] == f"at exit {interpreter.START_THRESHOLD[0]} True", p.stdout
