"""The README's commands in a terminal, stopped the ways users stop them (issue 30): Ctrl-C (SIGINT to
the terminal's whole foreground process group, make's output filters included), the terminal closed
(SIGHUP) and SIGTERM to the group (a scheduler, `kill -TERM -<pgid>`). Each case: the exit status, the
MLflow run's status and steps, the checkpoint kept, and that the next command resumes to the losses,
validation points and weights of an uninterrupted training (the Ctrl-C lands during a validation pass).
docs/details.md ("When a run is stopped") has the table.

The job is a tiny DPO (`make dpo` with its params given on make's command line: a preference model built
from config, dropout on so that the RNG state must resume too): `make dpo` is stopped by Ctrl-C and by the
closed terminal, then `make run` (`dvc repro` of the params `make dpo` left in params.yaml) finishes the same
training and is stopped by SIGTERM during evaluate. One chain here, not one per job (each costs a reference
training and a pipeline to its end); the default job (the classifier) stopped by SIGTERM resumes to the
uninterrupted losses in test_data_parallel_resume.py, stopped by Ctrl-C under `dvc repro` and resumed by a
queued experiment in test_lifecycle.py.

Through a pseudo-terminal (tests/integration/terminal.py), not a pipe or a background job: there the
shell makes the filters ignore SIGINT, which is why the broken pipe that lost `make run`'s training never
showed in a test. `make -o .venv/.installed` uses this environment's packages as they are.
"""
from __future__ import annotations

import csv
import json
import signal
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from onegpu.training.objectives.dpo import FIGURES

from .conftest import BIN, FAULTS, _env, client, copy_project, make_project, run, runs
from .terminal import Terminal

STEPS = 10
# A tiny DPO as `make dpo`'s -S params (its Makefile line's keys, and a model built from config): 24 pairs,
# 10 optimizer steps of 2 x 2 pairs (two epochs), validation every 2 steps, the best point kept.
DPO = {"data.source": "pairs.jsonl", "model.task": "preference", "model.name_or_path": "null",
       "model.n_layer": 2, "model.n_embd": 64, "model.n_head": 2, "model.vocab_size": 512, "model.dropout": 0.1,
       "train.dpo.disable_dropout": "false",  # dropout on in the policy: the RNG state must resume too
       "data.max_length": 48, "data.max_train_samples": 24, "data.max_eval_samples": 8,
       "train.per_device_train_batch_size": 2, "train.gradient_accumulation_steps": 2, "train.max_steps": STEPS,
       "train.learning_rate": 1e-3, "train.logging_steps": 1, "train.eval_steps": 2,
       "train.load_best_model_at_end": "true"}
MAKE_DPO = "make -o .venv/.installed dpo DPO='" + " ".join(f"-S {k}={v}" for k, v in DPO.items()) + "'"
MAKE_RUN = "make -o .venv/.installed run"


def _pairs() -> list[dict]:
    """40 preference pairs, answers of 1..5 words (uneven targets per micro-batch)."""
    words = ("rise", "fall", "win", "loss", "new", "late", "big", "cut", "plan", "deal")
    topics = ("rates", "storm", "final", "vote", "film", "court", "strike", "budget")
    return [{"prompt": f"Write a headline about the {topics[i % 8]} story number {i}.",
             "chosen": " ".join(words[(i + j) % 10] for j in range(1 + i % 5)).capitalize() + ".",
             "rejected": " ".join(words[(3 * i + j) % 10] for j in range(1 + (i + 2) % 5)).capitalize() + "?"}
            for i in range(40)]


def _losses(project: Path) -> list[float]:
    with open(project / "plots/train_steps.csv") as f:
        return [float(r["loss"]) for r in csv.DictReader(f)]


def _history(project: Path, run, key: str) -> list[tuple[int, float]]:
    """The run's metric ``key`` in MLflow: (step, value), in step order."""
    return sorted((m.step, m.value) for m in client(project).get_metric_history(run.info.run_id, key))


def _checkpoints(project: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in (project / ".onegpu/checkpoints").glob("*/checkpoint-*"))


def _train_runs(project: Path) -> list:
    _, _, all_runs = runs(project)
    return sorted((r for r in all_runs if r.data.tags.get("stage") == "train"), key=lambda r: r.info.start_time)


def _loss_steps(project: Path, run) -> list[int]:
    return [s for s, _ in _history(project, run, "loss")]


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
def terminal(tmp_path):
    """A tiny project (the default params: `make dpo` changes them) with the pairs committed and ``.venv``
    linked to this environment, and a terminal in it."""
    project = make_project(tmp_path / "p")
    (project / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _pairs()))
    run(["git", "add", "pairs.jsonl"], project)
    run(["git", "commit", "-qm", "pairs"], project)
    (project / ".venv").symlink_to(Path(sys.prefix))
    opened = []

    def open_terminal() -> Terminal:
        t = Terminal(project, {**_env(), "PYTHONUNBUFFERED": "1"})
        opened.append(t)
        return t
    yield project, open_terminal
    for t in opened:
        t.close()


def _make_dpo_stopped_by_ctrl_c(project: Path, term: Terminal) -> int:
    """Ctrl-C during the validation pass after step 2 (made 5 s longer by a test fault): the filters outlive
    it, train stops after the pass with a checkpoint that holds the point; the step it stopped after."""
    term.start(f"ONEGPU_TEST_FAULT=slow_validation:0:2 PYTHONPATH={FAULTS}${{PYTHONPATH:+:$PYTHONPATH}} {MAKE_DPO}")
    term.read_until(r"^test fault: validating after optimizer step 2$")
    term.ctrl_c()
    assert term.exit_status() != 0
    shown = term.output
    assert "SIGINT: stopping after the validation pass of optimizer step 2 and saving a checkpoint" in shown, shown
    assert "Traceback" not in shown, shown
    stopped = _checkpoints(project)[-1]
    assert (f"onegpu train: stopped by SIGINT after optimizer step {stopped}; kept the checkpoint of optimizer "
            f"step {stopped} (.onegpu/checkpoints/") in shown, shown
    assert "`make dpo` again (the same `dvc exp run`) resumes it" in shown, shown
    [first] = _train_runs(project)
    assert stopped == 2, shown
    assert first.info.status == "KILLED" and _loss_steps(project, first) == list(range(1, stopped + 1))
    assert [s for s, _ in _history(project, first, "eval_loss")] == [2]  # the pass it was stopped in, once
    assert "training_steps.png" in [a.path for a in client(project).list_artifacts(first.info.run_id)]
    # its MLflow page says so too, over its figure, with the command that resumes it
    assert first.data.tags["mlflow.note.content"].startswith(
        f"**Stopped by SIGINT** after optimizer step {stopped} (KILLED). To resume: `make dpo` again (the same "
        f"`dvc exp run`), from the checkpoint of optimizer step {stopped}.\n\n"
        "<a href=\"get-artifact?path=training_steps.png")
    return stopped


def test_make_dpo_stopped_by_ctrl_c_and_a_closed_terminal_and_make_run_by_sigterm_resume_to_the_uninterrupted_training(
        terminal, tmp_path):
    project, open_terminal = terminal
    term = open_terminal()
    stopped = _make_dpo_stopped_by_ctrl_c(project, term)

    # `make dpo` again; the terminal closed during the resumed training: SIGHUP to make's job, train stops as on
    # Ctrl-C.
    term.start(MAKE_DPO)
    term.read_until(rf"resuming from .*checkpoint-{stopped}")
    term.read_until(rf"^step {stopped + 2}/10 ")
    term.hang_up()
    _wait_until_ended(project, 1)
    second = _train_runs(project)[-1]
    hung_up = _checkpoints(project)[-1]
    assert second.info.status == "KILLED" and second.data.tags["error.message"].startswith("stopped by SIGHUP")
    assert stopped + 2 <= hung_up < STEPS and _loss_steps(project, second) == list(range(1, hung_up + 1))

    # `make run` (`dvc repro` of the params `make dpo` left) resumes the same training; SIGTERM to the job while
    # evaluate runs: the training is recorded, its evaluation is not.
    term = open_terminal()
    term.start(MAKE_RUN)
    term.read_until(rf"resuming from .*checkpoint-{hung_up}")
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
    assert "reward accuracy" in term.output[term.output.rindex("Stage 'train' didn't change"):]  # DPO's summary
    last = _train_runs(project)[-1]
    assert last.info.status == "FINISHED" and "test_rewards/accuracies" in last.data.metrics
    assert _loss_steps(project, last) == list(range(1, STEPS + 1))
    # one model, the finished training's, recorded by train and given its eval metrics by the later evaluate
    [model] = client(project).search_logged_models([last.info.experiment_id])  # the stopped trainings made none
    assert model.source_run_id == last.info.run_id
    assert {m.key: m.value for m in model.metrics}["test_loss"] == last.data.metrics["test_loss"]
    # each stopped run names the run that resumed it, and that one the run it resumed
    chain = _train_runs(project)
    assert [r.data.tags.get("onegpu.resumed_by") for r in chain[:2]] == [chain[1].info.run_id, chain[2].info.run_id]
    assert chain[2].data.tags["onegpu.resumed_from"] == chain[1].info.run_id
    _same_as_uninterrupted(project, last, tmp_path / "reference")


def _same_as_uninterrupted(project: Path, last, dest: Path) -> None:
    """The uninterrupted training (``onegpu train`` in a copy of ``project``: its params, data and store, no
    checkpoint) against the resumed one: per-step loss (plots/train_steps.csv) and DPO figures (MLflow, each
    step once), the validation points and best step, and the weights in models/, within 1e-6."""
    reference = copy_project(project, dest)
    run([str(BIN / "onegpu"), "train"], reference)
    ref_run = _train_runs(reference)[-1]  # (SCHEDULED: trained, its evaluation not run)
    assert ref_run.info.run_id != last.info.run_id and _loss_steps(reference, ref_run) == list(range(1, STEPS + 1))
    assert _losses(project) == pytest.approx(_losses(reference), abs=1e-6)
    assert len(set(_losses(project))) == STEPS  # a training that moves, not ln 2 at every step
    for key in (*FIGURES, "eval_loss", "eval_rewards/accuracies"):
        resumed, whole = _history(project, last, key), _history(reference, ref_run, key)
        assert [s for s, _ in resumed] == ([2, 4, 6, 8, 10] if key.startswith("eval_") else list(range(1, STEPS + 1)))
        assert [s for s, _ in resumed] == [s for s, _ in whole], key
        assert [v for _, v in resumed] == pytest.approx([v for _, v in whole], abs=1e-6), key
    assert len({v for _, v in _history(project, last, "rewards/margins")}) > 1
    assert last.data.tags["onegpu.best_step"] == ref_run.data.tags["onegpu.best_step"]
    assert last.data.tags["onegpu.dpo_reference"] == ref_run.data.tags["onegpu.dpo_reference"] == (
        "a frozen copy of the model as built (eval mode, no gradient)")
    weights, ref_weights = (load_file(p / "models/model/model.safetensors") for p in (project, reference))
    assert max(float((weights[k] - ref_weights[k]).abs().max()) for k in weights) <= 1e-6


@pytest.mark.slow  # make test-all: the terminal's stops are make test's in the test above
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
