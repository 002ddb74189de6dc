"""onegpu.interpreter: the `onegpu` command's garbage-collector settings, CPython's own while it trains; transformers'
torchao and scipy.optimize imports left out of a command's process (each such case in a fresh interpreter: the test
process imported transformers long ago), torchao's low-bit AdamW still there when ``train.optim`` asks for it."""
from __future__ import annotations

import gc
import importlib.util
import subprocess
import sys

import pytest

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
    # Asked of the objects themselves: the freeze count also drops whenever any thread of this process
    # frees a frozen object (the test once failed on 991,167 == 991,169 that way).
    scanned = {id(o) for o in gc.get_objects()}  # every generation a collection scans; frozen ones are not
    assert all(id(g) in scanned for g in garbage)


def test_settle_without_start_leaves_the_interpreter_as_it_is(collector):
    gc.unfreeze()
    gc.set_threshold(700, 10, 10)
    interpreter.settle()  # a library caller's training (a notebook, these tests, bench/)
    assert gc.get_threshold() == (700, 10, 10) and gc.get_freeze_count() == 0


def test_the_command_starts_tuned_and_main_alone_does_not(collector, monkeypatch):
    monkeypatch.setattr(sys, "stdout", sys.stdout)  # entry() wraps them (Tolerant): put back afterwards
    monkeypatch.setattr(sys, "stderr", sys.stderr)
    monkeypatch.setattr(interpreter, "stop_on_signals", lambda: None)  # this process's handlers stay pytest's
    seen = []
    monkeypatch.setattr(cli, "main", lambda argv=None: seen.append(gc.get_threshold()) or 0)
    gc.set_threshold(700, 10, 10)
    assert cli.entry() == 0 and seen == [interpreter.START_THRESHOLD]


def test_python_m_onegpu_runs_tuned_and_freezes_at_exit_with_the_commands_exit_code(tmp_path):
    """`python -m onegpu` (how a launch starts its ranks) goes through the same entry; a hook registered
    before it sees, at exit, the start-up threshold (no training settled it) and the objects frozen."""
    code = ("import atexit, gc, runpy, signal, sys; "
            "atexit.register(lambda: print('at exit', gc.get_threshold()[0], gc.get_freeze_count() > 0, "
            "signal.getsignal(signal.SIGTERM).__name__, signal.getsignal(signal.SIGHUP) == signal.SIG_IGN)); "
            "signal.signal(signal.SIGHUP, signal.SIG_IGN); "  # as nohup starts it
            "sys.argv = ['onegpu', 'summary', '--params', 'missing.yaml']; "
            "runpy.run_module('onegpu', run_name='__main__')")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert p.returncode == 2 and "onegpu summary: error:" in p.stderr, p.stderr
    # SIGTERM raises KeyboardInterrupt as Ctrl-C does; nohup's ignored SIGHUP stays ignored
    assert p.stdout.splitlines()[-1] == (f"at exit {interpreter.START_THRESHOLD[0]} True _raise_interrupt "
                                         "True"), p.stdout


# A command whose reader goes away mid-run: the pipe's read end is closed before the command writes, as
# when a `make` output filter dies on Ctrl-C before the training's next progress line.
LOST_READER = ("import sys, time; from onegpu import interpreter; interpreter.start(); "
               "time.sleep(0.5); [print('progress line', i, flush=True) for i in range(3)]; "
               "print('to stderr', file=sys.stderr, flush=True); print('lost:', type(sys.stdout.lost).__name__, "
               "file=open(sys.argv[1], 'w')); print('unflushed at exit')")


def test_a_command_whose_reader_went_away_keeps_going_and_exits_0(tmp_path):
    import os
    out, err = os.pipe(), os.pipe()
    p = subprocess.Popen([sys.executable, "-c", LOST_READER, str(tmp_path / "seen")], stdout=out[1], stderr=err[1])
    for fd in (*out, *err):
        os.close(fd)  # both readers gone before the first write: EPIPE on each
    assert p.wait(timeout=60) == 0
    assert (tmp_path / "seen").read_text() == "lost: BrokenPipeError\n"


def test_the_same_command_without_tolerant_streams_fails(tmp_path):
    """What the wrapper prevents: the first progress line raises BrokenPipeError."""
    import os
    code = LOST_READER.replace("interpreter.start(); ", "")
    r, w = os.pipe()
    p = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "seen")], stdout=w, stderr=subprocess.DEVNULL)
    os.close(w)
    os.close(r)
    assert p.wait(timeout=60) == 1 and not (tmp_path / "seen").exists()


def test_tolerant_streams_write_through_while_the_reader_is_there(capsys):
    stream = interpreter.Tolerant(sys.stdout)
    assert stream.write("step 1/3\n") == 9 and stream.lost is None
    stream.flush()
    assert capsys.readouterr().out == "step 1/3\n"


def test_sigterm_ends_a_command_as_ctrl_c_does_with_128_plus_the_signal(tmp_path):
    """`onegpu ui` stands for any command that is not training: SIGTERM must reach its KeyboardInterrupt
    path (the guard's KILLED, the cli's last line), not end the process at once."""
    import signal

    from tests import defaults
    (tmp_path / "params.yaml").write_text(defaults.params_text())
    code = ("import sys, time; from onegpu import cli; sys.argv = ['onegpu', 'summary']; "
            "from onegpu import summary; summary.text = lambda cfg: print('ready', flush=True) or time.sleep(60); "
            "sys.exit(cli.entry())")
    p = subprocess.Popen([sys.executable, "-c", code], cwd=tmp_path, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline() == "ready\n"  # inside the command, its handlers installed
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=60) == 128 + signal.SIGTERM
    assert "onegpu summary: interrupted by SIGTERM" in p.stderr.read()


def test_a_command_prints_no_import_time_lines_about_kernels_it_never_calls():
    """transformers imports torchao when it is installed (train.optim adamw_torch_8bit/4bit): its warnings
    about prebuilt extensions for other Pythons and GPUs, and torch's pytree deprecations they trigger,
    were four lines in every stage's output, and torch's compile-cache warning two more in a torchao
    optimizer's first step; a command keeps their errors only."""
    import logging
    code = ("from onegpu import interpreter\ninterpreter.start()\nfrom transformers import PreTrainedModel\n"
            "import logging, warnings\nprint(logging.getLogger('torchao').getEffectiveLevel())\n"
            "warnings.warn('OptimState8bit does not implement _stable_hash_for_caching. For PT2 ...', UserWarning)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == [str(logging.ERROR)]
    assert "Failed to load" not in out.stderr and "Enum subclass" not in out.stderr, out.stderr
    assert "_stable_hash_for_caching" not in out.stderr  # torch compiling torchao's step (train.optim 8/4-bit)


needs_torchao = pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="torchao is not installed")

# A stage's imports: a model class, Trainer and its optimizer table, after the command's start (or not).
IMPORTS = """
import sys
if sys.argv[1] == "start":
    from onegpu import interpreter
    interpreter.start()
from transformers import BertForSequenceClassification, LlamaForCausalLM, Trainer, TrainingArguments
print(sorted(m for m in ("torchao", "scipy.optimize") if m in sys.modules))
"""

LOW_BIT = """
import sys
from onegpu import interpreter
interpreter.start()
from transformers import Trainer
from onegpu.config import from_container
from onegpu.training.backends import hf_trainer
cfg = from_container({"train": {"optim": sys.argv[1]}}, source="test")
args = hf_trainer.training_arguments(cfg, sys.argv[2])
cls, _ = Trainer.get_optimizer_cls_and_kwargs(args)
print(cls.__module__, cls.__name__)
"""


def _run_code(code: str, *args: str) -> str:
    p = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout.strip().splitlines()[-1]


@needs_torchao
def test_a_commands_process_imports_neither_torchao_nor_scipy_optimize_with_transformers():
    assert _run_code(IMPORTS, "start") == "[]"
    assert _run_code(IMPORTS, "library") == "['scipy.optimize', 'torchao']"  # as transformers does by itself


@needs_torchao
@pytest.mark.parametrize("optim, name", [("adamw_torch_8bit", "AdamW8bit"), ("adamw_torch_4bit", "AdamW4bit")])
def test_torchaos_low_bit_adamw_is_there_when_train_optim_asks_for_it(tmp_path, optim, name):
    module, cls = _run_code(LOW_BIT, optim, str(tmp_path)).split()
    assert module.startswith("torchao.") and cls == name
