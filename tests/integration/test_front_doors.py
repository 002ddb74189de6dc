"""The README's commands in a terminal, stopped the ways users stop them (issue 30): Ctrl-C (SIGINT to
the terminal's whole foreground process group, make's output filters included), the terminal closed
(SIGHUP) and SIGTERM to the group (a scheduler, `kill -TERM -<pgid>`). Each case: the exit status, the
MLflow run's status and steps, the checkpoint kept, and that the next `make run` resumes to the
losses, validation points and weights of an uninterrupted training (the Ctrl-C lands during a
validation pass). docs/details.md ("When a run is stopped") has the table.

Through a pseudo-terminal (tests/integration/terminal.py), not a pipe or a background job: there the
shell makes the filters ignore SIGINT, which is why the broken pipe that lost `make run`'s training never
showed in a test. `make -o .venv/.installed` uses this environment's packages as they are.
"""
from __future__ import annotations

import csv
import signal
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from .conftest import BIN, _env, client, run, runs
from .terminal import Terminal

pytestmark = pytest.mark.slow

STEPS = 10
PARAMS = {"train": {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2, "max_steps": STEPS,
                    "logging_steps": 1, "eval_steps": 2, "load_best_model_at_end": True},
          "model": {"dropout": 0.1}}  # dropout: the RNG state must resume too
FAULTS = Path(__file__).with_name("faults")  # sitecustomize.py: ONEGPU_TEST_FAULT=slow_validation:<rank>:<step>
MAKE_RUN = "make -o .venv/.installed run"


def _losses(project: Path) -> list[float]:
    with open(project / "plots/train_steps.csv") as f:
        return [float(r["loss"]) for r in csv.DictReader(f)]


def _evals(project: Path, run) -> list[tuple[int, float]]:
    """The run's validation points in MLflow: (step, eval_loss), in step order."""
    return sorted((m.step, m.value) for m in client(project).get_metric_history(run.info.run_id, "eval_loss"))


def _checkpoints(project: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in (project / ".onegpu/checkpoints").glob("*/checkpoint-*"))


def _train_runs(project: Path) -> list:
    _, _, all_runs = runs(project)
    return sorted((r for r in all_runs if r.data.tags.get("stage") == "train"), key=lambda r: r.info.start_time)


def _loss_steps(project: Path, run) -> list[int]:
    return sorted(m.step for m in client(project).get_metric_history(run.info.run_id, "loss"))


def _wait_until_ended(project: Path, runs_before: int, timeout: float = 300) -> None:
    """After a hang-up nothing is left to report: wait until the newest training run has ended."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        train = _train_runs(project)
        if len(train) > runs_before and train[-1].info.status != "RUNNING":
            return
        time.sleep(1)
    raise AssertionError("the training run was still RUNNING after the terminal closed")


@pytest.fixture
def terminal(tmp_path, prepared):
    """A prepared project with ``.venv`` linked to this environment, and a terminal in it."""
    project = prepared(tmp_path / "p", PARAMS)
    (project / ".venv").symlink_to(Path(sys.prefix))
    opened = []

    def open_terminal() -> Terminal:
        t = Terminal(project, {**_env(), "PYTHONUNBUFFERED": "1"})
        opened.append(t)
        return t
    yield project, open_terminal
    for t in opened:
        t.close()


def test_make_run_stopped_by_ctrl_c_a_closed_terminal_and_sigterm_resumes_to_the_uninterrupted_training(terminal):
    project, open_terminal = terminal
    run([str(BIN / "onegpu"), "train"], project)  # the uninterrupted reference (outside DVC: dvc.lock unchanged)
    reference = _losses(project), load_file(project / "models/model/model.safetensors")

    # Ctrl-C during the validation pass after step 2 (made 5 s longer by a test fault): the filters outlive
    # it, train stops after the pass with a checkpoint that holds the point.
    term = open_terminal()
    term.start(f"ONEGPU_TEST_FAULT=slow_validation:0:2 PYTHONPATH={FAULTS} {MAKE_RUN}")
    term.read_until(r"^test fault: validating after optimizer step 2$")
    term.ctrl_c()
    assert term.exit_status() != 0
    shown = term.output
    assert "SIGINT: stopping after the validation pass of optimizer step 2 and saving a checkpoint" in shown, shown
    assert "Traceback" not in shown, shown
    stopped = _checkpoints(project)[-1]
    assert (f"onegpu train: stopped by SIGINT after optimizer step {stopped}; kept the checkpoint of optimizer "
            f"step {stopped} (.onegpu/checkpoints/") in shown, shown
    assert "`make run` again (`dvc repro`) resumes it" in shown
    first = _train_runs(project)[-1]
    assert stopped == 2, shown
    assert first.info.status == "KILLED" and _loss_steps(project, first) == list(range(1, stopped + 1))
    assert [s for s, _ in _evals(project, first)] == [2]  # the pass it was stopped in, completed once
    assert "training_steps.png" in [a.path for a in client(project).list_artifacts(first.info.run_id)]
    # its MLflow page says so too, over its figure, with the command that resumes it
    assert first.data.tags["mlflow.note.content"].startswith(
        f"**Stopped by SIGINT** after optimizer step {stopped} (KILLED). To resume: `make run` again (`dvc repro`), "
        f"from the checkpoint of optimizer step {stopped}.\n\n<a href=\"get-artifact?path=training_steps.png")

    # The terminal closed during the resumed training: SIGHUP to make's job; train stops as on Ctrl-C.
    term.start(MAKE_RUN)
    term.read_until(rf"resuming from .*checkpoint-{stopped}")
    term.read_until(rf"^step {stopped + 2}/10 ")
    term.hang_up()
    _wait_until_ended(project, 2)
    second = _train_runs(project)[-1]
    hung_up = _checkpoints(project)[-1]
    assert second.info.status == "KILLED" and second.data.tags["error.message"].startswith("stopped by SIGHUP")
    assert stopped + 2 <= hung_up < STEPS and _loss_steps(project, second) == list(range(1, hung_up + 1))

    # SIGTERM to the job while evaluate runs: the training is recorded, its evaluation is not.
    term = open_terminal()
    term.start(MAKE_RUN)
    term.read_until(r"Running stage 'evaluate'")
    term.signal_group(signal.SIGTERM)
    assert term.exit_status() != 0
    evaluated = _train_runs(project)[-1]
    assert evaluated.info.status in ("KILLED", "SCHEDULED")  # stopped before or after it re-opened
    if evaluated.info.status == "KILLED":  # its page: the evaluation stopped, rerun it (not the training)
        assert evaluated.data.tags["mlflow.note.content"].startswith("**Evaluation stopped**")
    assert _checkpoints(project) == []  # the training finished: nothing left to resume

    # And once more: train is up to date, evaluate runs; the whole curve equals the uninterrupted one.
    assert term.run(MAKE_RUN) == 0, term.output[-3000:]
    assert "Stage 'train' didn't change, skipping" in term.output and "onegpu: done." in term.output
    last = _train_runs(project)[-1]
    assert last.info.status == "FINISHED" and "test_accuracy" in last.data.metrics
    assert _loss_steps(project, last) == list(range(1, STEPS + 1))
    # one model, the finished training's, recorded by train and given its eval metrics by the later evaluate
    models = client(project).search_logged_models([last.info.experiment_id])
    assert len(models) == 2  # the reference training's and this one's; the stopped trainings made none
    [model] = [m for m in models if m.source_run_id == last.info.run_id]
    assert {m.key: m.value for m in model.metrics}["test_accuracy"] == last.data.metrics["test_accuracy"]
    # each stopped run names the run that resumed it, and that one the run it resumed
    chain = _train_runs(project)[1:]
    assert [r.data.tags.get("onegpu.resumed_by") for r in chain[:2]] == [chain[1].info.run_id, chain[2].info.run_id]
    assert chain[2].data.tags["onegpu.resumed_from"] == chain[1].info.run_id
    assert _losses(project) == pytest.approx(reference[0], abs=1e-6)
    # one validation point per step, none twice, the uninterrupted run's; the same best step kept in models/
    ref_run = _train_runs(project)[0]
    assert [s for s, _ in _evals(project, last)] == [2, 4, 6, 8, 10]
    assert [v for _, v in _evals(project, last)] == pytest.approx([v for _, v in _evals(project, ref_run)], abs=1e-6)
    assert last.data.tags["onegpu.best_step"] == ref_run.data.tags["onegpu.best_step"]
    weights = load_file(project / "models/model/model.safetensors")
    assert max(float((weights[k] - reference[1][k]).abs().max()) for k in weights) <= 1e-6


def test_onegpu_tradeoffs_stopped_by_ctrl_c_says_how_many_repeats_each_row_measured(tmp_path, prepared):
    """Ctrl-C while the second round's baseline trains: the table and the report say each row's measured
    repeats ("1 of 2 repeats measured, then stopped"), not "not run", and nothing is left running."""
    project = prepared(tmp_path / "p")
    term = Terminal(project, {**_env(), "PYTHONUNBUFFERED": "1"})
    try:
        term.start("onegpu tradeoffs --knobs split --repeats 2 --steps 5 --no-combine")  # 4 steps of margin
        term.read_until(r"^row 3 of 4: ")
        term.read_until(r"^step 1/")  # the row's worker is training
        term.ctrl_c()
        assert term.exit_status() == 130
    finally:
        term.close()
    shown = term.output
    assert "Traceback" not in shown, shown
    table = shown[shown.rindex("verdict"):]
    assert "baseline" in table and "1 of 2 repeats measured, then stopped" in table, table
    assert "1 of 2 repeats measured, then not run" in table and "| not run" not in table, table
    assert "1 of 2 repeats measured, then stopped" in (project / "reports" / "tradeoffs.md").read_text()
    _, _, all_runs = runs(project)
    assert [r.info.run_name for r in all_runs if r.info.status == "RUNNING"] == []
