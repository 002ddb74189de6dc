"""`make grpo` in a terminal, stopped by Ctrl-C (SIGINT to the terminal's whole foreground process group) and run
again: the stop keeps a checkpoint and says how to resume, and the resumed training samples the same completions
and trains the same steps as an uninterrupted one (per-step loss and TRL's figures, the completions table's rows).

The job is a tiny GRPO (`make grpo` with its params given on make's command line: a GPT-2 built from config,
dropout on so that the RNG state must resume too, 4 completions a prompt, a reward of the project's own module),
through a pseudo-terminal as in test_front_doors.py.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from .conftest import BIN, _env, client, copy_project, make_project, run
from .terminal import Terminal
from .test_front_doors import _checkpoints, _history, _loss_steps, _losses, _train_runs

STEPS = 6
GRPO = {"data.source": "prompts.jsonl", "model.task": "grpo", "model.name_or_path": "null",
        "model.n_layer": 2, "model.n_embd": 64, "model.n_head": 2, "model.vocab_size": 512, "model.dropout": 0.1,
        "data.max_length": 32, "data.max_train_samples": 24, "data.max_eval_samples": 4,
        "train.per_device_train_batch_size": 4, "train.gradient_accumulation_steps": 2, "train.max_steps": STEPS,
        "train.learning_rate": 1e-3, "train.logging_steps": 1, "train.eval_steps": 3,
        "train.grpo.num_generations": 4, "train.grpo.max_completion_length": 6,
        "train.grpo.reward_funcs": "[project_rewards:letters]"}
MAKE_GRPO = "make -o .venv/.installed grpo GRPO='" + " ".join(f"-S {k}={v}" for k, v in GRPO.items()) + "'"
REWARDS = '''def letters(prompts, completions, **columns):
    """The share of a completion's characters that are letters (varies within a random model's groups)."""
    return [sum(c.isalpha() for c in text) / max(len(text), 1) for text in completions]
'''
FIGURES = ("reward", "reward_std", "rewards/letters/mean", "completions/mean_length")


@pytest.fixture
def project(tmp_path):
    project = make_project(tmp_path / "p")
    rows = [{"prompt": f"What is {i} plus {i + 2}?", "answer": str(2 * i + 2)} for i in range(40)]
    (project / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (project / "project_rewards.py").write_text(REWARDS)
    run(["git", "add", "prompts.jsonl", "project_rewards.py"], project)
    run(["git", "commit", "-qm", "prompts"], project)
    (project / ".venv").symlink_to(Path(sys.prefix))
    return project


def test_make_grpo_stopped_by_ctrl_c_resumes_to_the_uninterrupted_training(project, tmp_path):
    term = Terminal(project, {**_env(), "PYTHONUNBUFFERED": "1"})
    try:
        term.start(MAKE_GRPO)
        term.read_until(r"^step 2/6 ")
        term.ctrl_c()
        assert term.exit_status() != 0
        stopped = _checkpoints(project)[-1]
        assert 2 <= stopped < STEPS, term.output
        assert "`make grpo` again (the same `dvc exp run`) resumes it" in term.output, term.output
        [first] = _train_runs(project)
        assert first.info.status == "KILLED" and _loss_steps(project, first) == list(range(1, stopped + 1))
        (tmp_path / "stopped").mkdir()  # the stopped run keeps the completions of the steps it trained
        kept = json.loads(Path(client(project).download_artifacts(first.info.run_id, "completions.json",
                                                                   str(tmp_path / "stopped"))).read_text())
        assert [row[0] for row in kept["data"]] == [s for s in range(1, stopped + 1) for _ in range(8)]
        assert term.run(MAKE_GRPO) == 0, term.output[-3000:]
        assert "resuming from" in term.output and "pass rate" in term.output
    finally:
        term.close()
    last = _train_runs(project)[-1]
    assert last.info.status == "FINISHED" and _loss_steps(project, last) == list(range(1, STEPS + 1))
    reference = copy_project(project, tmp_path / "reference")
    run([str(BIN / "onegpu"), "train"], reference)
    whole = _train_runs(reference)[-1]
    assert _losses(project) == pytest.approx(_losses(reference), abs=1e-6)
    for key in FIGURES:
        resumed, ref = _history(project, last, key), _history(reference, whole, key)
        assert [s for s, _ in resumed] == [s for s, _ in ref] == list(range(1, STEPS + 1)), key
        assert [v for _, v in resumed] == pytest.approx([v for _, v in ref], abs=1e-6), key
    assert len({v for _, v in _history(project, last, "reward")}) > 1
    tables = []
    for name, p, r in (("resumed", project, last), ("whole", reference, whole)):
        (tmp_path / name).mkdir()  # (MLflow's default destination is a new temporary folder it leaves behind)
        tables.append(json.loads(Path(client(p).download_artifacts(r.info.run_id, "completions.json",
                                                                   str(tmp_path / name))).read_text()))
    assert tables[0]["data"] == tables[1]["data"] and len(tables[0]["data"]) == 8 * STEPS  # every step logged
