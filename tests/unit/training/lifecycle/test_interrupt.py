"""onegpu.training.lifecycle.interrupt: the three stop signals in each phase of a training run, the line a SIGTERM
prints when a step is long, the command that resumes a stopped training, and the stage's last line."""
from __future__ import annotations

import os
import signal

import pytest

from onegpu.training.lifecycle import interrupt
from onegpu.training.lifecycle.interrupt import GracefulStop, Interrupted


def _send(signum: int) -> None:
    os.kill(os.getpid(), signum)  # handled in this (the main) thread before os.kill returns


@pytest.fixture(autouse=True)
def default_sighup():
    """SIGHUP at its default, as a terminal's command starts: this suite may run under nohup (SIGHUP
    ignored), which GracefulStop rightly leaves ignored."""
    old = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    yield
    signal.signal(signal.SIGHUP, old)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_in_the_loop_the_first_signal_asks_for_a_stop_and_the_second_abandons_the_step(signum):
    with GracefulStop() as stop, stop.loop():
        _send(signum)
        assert stop.requested == signum
        with pytest.raises(KeyboardInterrupt) as e:
            _send(signum)
    assert e.value.signum == signum
    assert str(e.value) == (f"{signal.Signals(signum).name} stopped the optimizer step in progress, abandoned "
                            "(no new checkpoint)")


def test_a_closed_terminals_second_sighup_is_the_same_event_not_a_second_request():
    """Bash passes SIGHUP to its jobs, then the kernel sends it to the foreground group when bash exits."""
    with GracefulStop() as stop, stop.loop():
        _send(signal.SIGHUP)
        _send(signal.SIGHUP)
        assert stop.requested == signal.SIGHUP and stop.noted == [signal.SIGHUP]
        with pytest.raises(KeyboardInterrupt):  # Ctrl-C still abandons the step
            _send(signal.SIGINT)


@pytest.mark.parametrize("signum", interrupt.SIGNALS)
def test_before_the_loop_a_signal_abandons_the_run_and_after_it_only_notes(signum, capsys):
    with GracefulStop() as stop:
        with pytest.raises(KeyboardInterrupt):  # building the model: nothing trained, nothing to save
            _send(signum)
        with stop.loop():
            pass
        for _ in range(3):  # the run's record is being written: nothing may cut it short
            _send(signum)
        assert stop.noted == [signum] * 3 and stop.requested is None
    assert "it stops after that" in capsys.readouterr().err


def test_after_the_loop_the_launchers_sigterm_after_a_peers_failure_is_said_to_be_the_launchers(
        tmp_path, monkeypatch, capsys):
    """A launch's process writing its run's record when the launcher stops it (a peer noted its failure): the line
    says whose SIGTERM it is; without a peer's note (a user's signal), as before."""
    from onegpu.training.parallel import distributed
    monkeypatch.setenv(distributed.LAUNCH_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    (tmp_path / "failed-0.json").write_text("{}")  # its own note: not a peer's
    with GracefulStop() as stop:
        with stop.loop():
            pass
        _send(signal.SIGTERM)
        (tmp_path / "failed-1.json").write_text("{}")
        _send(signal.SIGTERM)
    assert capsys.readouterr().err.splitlines() == [
        "SIGTERM: the run's record is being written first (its steps, tags and figure); it stops after that",
        "SIGTERM (the launcher's: a peer process failed): the run's record is being written first (its steps, tags "
        "and figure); it stops after that"]


def test_a_probe_row_without_checkpoints_is_abandoned_by_the_first_signal():
    with GracefulStop(checkpoints=False) as stop, stop.loop():
        with pytest.raises(KeyboardInterrupt):
            _send(signal.SIGINT)


def test_handlers_are_restored_and_nohups_ignored_sighup_stays_ignored():
    old = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        before = signal.getsignal(signal.SIGTERM)
        with GracefulStop() as stop, stop.loop():
            assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
            _send(signal.SIGHUP)  # ignored: the training goes on
            assert stop.requested is None
        assert signal.getsignal(signal.SIGTERM) == before
    finally:
        signal.signal(signal.SIGHUP, old)


@pytest.mark.parametrize("step_s, said", [(2.0, False), (40.0, True)])
def test_sigterm_says_plainly_when_a_step_may_not_fit_a_schedulers_grace_period(step_s, said, capsys):
    with GracefulStop(progress=lambda: (7, step_s, 5)) as stop, stop.loop():
        _send(signal.SIGTERM)
    err = capsys.readouterr().err
    assert "SIGTERM: stopping after optimizer step 8 and saving a checkpoint" in err
    assert ("about 40 s here" in err and "30 s from SIGTERM to SIGKILL" in err
            and "the newest complete checkpoint is that of step 5" in err) == said


@pytest.mark.parametrize("env, cwd, expected", [
    ({"DVC_STAGE": "train", "MAKELEVEL": "1"}, "/p", "`make run` again (`dvc repro`)"),
    ({"DVC_STAGE": "train"}, "/p", "`dvc repro`"),
    ({"DVC_STAGE": "train", "DVC_EXP_NAME": "sft", "MAKELEVEL": "1", "ONEGPU_MAKE_TARGET": "sft"}, "/p",
     "`make sft` again (the same `dvc exp run`)"),
    ({"DVC_STAGE": "train", "DVC_EXP_NAME": "dpo", "MAKELEVEL": "1", "ONEGPU_MAKE_TARGET": "dpo"}, "/p",
     "`make dpo` again (the same `dvc exp run`)"),
    ({"DVC_STAGE": "train", "DVC_EXP_NAME": "x", "MAKELEVEL": "1"}, "/p", "the same `dvc exp run`"),  # another make
    ({"DVC_STAGE": "train", "DVC_EXP_NAME": "x"}, "/p", "the same `dvc exp run`"),
    ({"DVC_STAGE": "train", "DVC_EXP_NAME": "x"}, "/p/.dvc/tmp/exps/tmpab12", "queueing the same experiment again"),
    ({}, "/p", "`onegpu train` again"),
])
def test_the_resume_command_is_the_front_door_the_stage_was_started_from(monkeypatch, env, cwd, expected):
    for k in ("DVC_STAGE", "DVC_EXP_NAME", "MAKELEVEL", "ONEGPU_MAKE_TARGET"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(os, "getcwd", lambda: cwd)
    assert interrupt.resume_command().startswith(expected)


def test_the_makefiles_training_recipes_name_their_target_for_the_resume_command():
    """`make dpo` stopped said "`make sft` again" while make's own environment named no target: each recipe
    that trains sets ``ONEGPU_MAKE_TARGET`` to its own name."""
    from pathlib import Path
    lines = (Path(__file__).resolve().parents[4] / "Makefile").read_text().splitlines()
    for target in ("run", "sft", "dpo"):
        recipe = lines[lines.index(f"{target}: install") + 1]
        assert f" {interrupt.MAKE_TARGET}={target} " in recipe and " dvc " in recipe.replace("/", " "), recipe


def test_the_last_line_names_the_signal_what_was_kept_and_how_to_resume(monkeypatch):
    monkeypatch.setenv("DVC_STAGE", "train")
    monkeypatch.delenv("DVC_EXP_NAME", raising=False)
    monkeypatch.delenv("MAKELEVEL", raising=False)
    e = Interrupted(signal.SIGHUP, 6)
    e.run_id, e.steps_logged, e.checkpoint = "abc123", 6, ".onegpu/checkpoints/k/checkpoint-6"
    assert interrupt.describe(e) == (
        "stopped by SIGHUP after optimizer step 6; kept the checkpoint of optimizer step 6 "
        "(.onegpu/checkpoints/k/checkpoint-6) and its 6 steps in MLflow run abc123 (KILLED); `dvc repro` resumes it")
    assert interrupt.describe(interrupt.stopped_by(signal.SIGTERM)) == "interrupted by SIGTERM"
    assert interrupt.describe(interrupt.stopped_by(signal.SIGINT, "the run before its training began")) == (
        "SIGINT stopped the run before its training began")


def test_a_signal_during_a_validation_pass_says_the_run_stops_after_the_pass():
    """Between two optimizer steps (the pass after step 3) the stop line names the pass, not step 4."""
    from onegpu.training.lifecycle import interrupt
    stop = interrupt.GracefulStop(progress=lambda: (3, 1.0, None))
    assert "stopping after optimizer step 4 and saving" in stop._stop_line("SIGINT")
    with interrupt.validating(3):
        line = stop._stop_line("SIGINT")
    assert line.strip() == ("SIGINT: stopping after the validation pass of optimizer step 3 and saving a checkpoint "
                            "(send it again to abandon the pass)")
    assert interrupt.VALIDATING == []


def test_of_a_launchs_processes_rank_0_alone_says_the_stop_and_every_one_stops(monkeypatch, capsys):
    """Ctrl-C reaches every process of the foreground group: one stop line (rank 0's), not one per process."""
    for rank, said in (("1", ""), ("0", "SIGINT: stopping after this optimizer step")):
        monkeypatch.setenv("RANK", rank)
        with GracefulStop() as stop, stop.loop():
            _send(signal.SIGINT)
            assert stop.requested == signal.SIGINT  # every process stops after the step in progress
        err = capsys.readouterr().err
        assert (said in err if said else err == ""), (rank, err)
