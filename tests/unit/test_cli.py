"""The ``onegpu`` command: a bad params file stops a stage at once with one line naming the key."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests import defaults


def _onegpu(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("DVC_ROOT", "MLFLOW_TRACKING_URI")}
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "onegpu", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)
    print(f"onegpu {' '.join(args)}: exit {proc.returncode} in {time.perf_counter() - t:.2f} s")
    return proc


def _write_params(tmp_path: Path, mutate) -> Path:
    d = defaults.params()
    mutate(d)
    p = tmp_path / "params.yaml"
    p.write_text(yaml.safe_dump(d))
    return p


def _assert_one_error_line(proc: subprocess.CompletedProcess, command: str) -> str:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"onegpu {command}: error:"), lines[0]
    return lines[0]


def test_train_with_unknown_key_exits_2_naming_the_key(tmp_path):
    p = _write_params(tmp_path, lambda d: d["train"].__setitem__("gradient_acumulation_steps", 4))
    proc = _onegpu(["train", "--params", str(p)], cwd=tmp_path)
    line = _assert_one_error_line(proc, "train")
    assert "train.gradient_acumulation_steps" in line
    assert "gradient_accumulation_steps'?" in line  # the suggestion
    assert proc.stdout == ""
    # validation happens before any work: nothing was written
    assert sorted(x.name for x in tmp_path.iterdir()) == ["params.yaml"]


@pytest.mark.parametrize("command", ["prepare", "evaluate"])
def test_other_stages_validate_too(tmp_path, command):
    p = _write_params(tmp_path, lambda d: d["train"].__setitem__("per_device_train_batch_size", 0))
    line = _assert_one_error_line(_onegpu([command, "--params", str(p)], cwd=tmp_path), command)
    assert "train.per_device_train_batch_size" in line


def test_missing_params_file_exits_2(tmp_path):
    line = _assert_one_error_line(_onegpu(["train"], cwd=tmp_path), "train")
    assert "params.yaml not found" in line


def test_invalid_yaml_exits_2(tmp_path):
    p = tmp_path / "params.yaml"
    p.write_text("train: [unclosed\n")
    proc = _onegpu(["train", "--params", str(p)], cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    # The YAML parser's message spans several lines (with the line and column); the first names the file.
    first = proc.stderr.splitlines()[0]
    assert first.startswith("onegpu train: error:"), first
    assert "params.yaml is not valid YAML" in first
    assert "line 1" in proc.stderr or "line 2" in proc.stderr


def test_unknown_command_is_usage_error(tmp_path):
    proc = _onegpu(["trian"], cwd=tmp_path)
    assert proc.returncode == 2
    assert "invalid choice" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_help_lists_commands(tmp_path):
    proc = _onegpu(["--help"], cwd=tmp_path)
    assert proc.returncode == 0
    for c in ("prepare", "train", "evaluate", "ui"):
        assert c in proc.stdout


def _git_project(root: Path) -> Path:
    """A git repository whose committed params.yaml is the project's default."""
    root.mkdir(parents=True)
    for args in (["init", "-q"], ["config", "user.email", "t@example.invalid"], ["config", "user.name", "t"]):
        subprocess.run(["git", *args], cwd=root, check=True)
    defaults.write_params(root)
    subprocess.run(["git", "add", "params.yaml"], cwd=root, check=True)
    subprocess.run(["git", "commit", "-qm", "params"], cwd=root, check=True)
    return root


def _like_a_failed_dvc_exp_run(params: Path) -> None:
    """What `dvc exp run -S train.learning_rat=1e-3` leaves: the typo key written, nulls blanked."""
    text = params.read_text().replace("  learning_rate:", "  learning_rat: 1.0e-3\n  learning_rate:")
    params.write_text(text.replace(": null", ":"))


def test_a_failed_stage_names_the_changed_params_file_and_how_to_restore_it(tmp_path):
    root = _git_project(tmp_path / "proj")
    _like_a_failed_dvc_exp_run(root / "params.yaml")
    line = _assert_one_error_line(_onegpu(["prepare"], cwd=root), "prepare")
    assert "unknown key 'train.learning_rat'" in line
    assert line.endswith("; params.yaml differs from git's HEAD (`dvc exp run -S` writes its values there first "
                         "and keeps them when a stage fails): `git diff params.yaml` shows what, "
                         "`git checkout params.yaml` restores the committed one"), line


def test_an_unexpected_error_names_the_changed_params_file_above_its_traceback_once_per_launch(monkeypatch, capsys):
    """An error that is no bad input: its traceback, under one line with the params note; in a launch's process
    nothing (the launcher's last line names the failed rank and carries the note, once for the launch)."""
    from onegpu import cli

    def broken(args, cfg):
        raise RuntimeError("a bug")
    monkeypatch.setitem(cli.COMMANDS, "summary", broken)
    monkeypatch.setattr(cli, "_params_note", lambda args: "; params.yaml differs")
    monkeypatch.setattr("onegpu.config.load", lambda *a, **kw: None)
    for world, said in (("1", "onegpu summary: error (traceback below); params.yaml differs\n"), ("2", "")):
        monkeypatch.setenv("WORLD_SIZE", world)
        with pytest.raises(RuntimeError, match="a bug"):
            cli.main(["summary"])
        assert capsys.readouterr().err == said


def test_no_params_note_when_the_file_is_as_committed_or_in_dvcs_temp_clone(tmp_path):
    root = _git_project(tmp_path / "proj")
    _like_a_failed_dvc_exp_run(root / "params.yaml")
    subprocess.run(["git", "commit", "-qam", "a bad value, committed"], cwd=root, check=True)
    line = _assert_one_error_line(_onegpu(["train"], cwd=root), "train")
    assert "learning_rat" in line and "differs from git's HEAD" not in line
    # a queued/--temp experiment's clone: params.yaml holds the -S values, the user's file does not
    clone = _git_project(root / ".dvc" / "tmp" / "exps" / "tmpabc")
    _like_a_failed_dvc_exp_run(clone / "params.yaml")
    line = _assert_one_error_line(_onegpu(["train"], cwd=clone), "train")
    assert "learning_rat" in line and "differs from git's HEAD" not in line


@pytest.mark.parametrize("args, steps, repeats", [([], 6, None), (["--steps", "4", "--repeats", "2"], 4, 2),
                                                  (["--full", "--repeats", "1"], None, 1)])
def test_tradeoffs_window_and_repeats_reach_the_stage(tmp_path, monkeypatch, args, steps, repeats):
    """--steps N (the probe window; default 6), --full (None: the whole job), --repeats R (default None: up to
    3 windows a row, the adaptive rounds)."""
    from onegpu import cli
    from onegpu.stages import tradeoffs
    defaults.write_params(tmp_path)
    monkeypatch.chdir(tmp_path)
    got = []
    monkeypatch.setattr(tradeoffs, "run", got.append)
    assert cli.main(["tradeoffs", *args]) == 0
    [req] = got
    assert (req.steps, req.repeats, req.params, req.out_dir) == (steps, repeats, "params.yaml", "reports")
    assert req.cfg.tracking.experiment_name == "onegpu"


def test_tradeoffs_arguments_reach_the_stage_as_one_request(tmp_path, monkeypatch):
    from onegpu import cli
    from onegpu.stages import tradeoffs
    defaults.write_params(tmp_path)
    monkeypatch.chdir(tmp_path)
    got = []
    monkeypatch.setattr(tradeoffs, "run", got.append)
    assert cli.main(["tradeoffs", "--knobs", "split, packing", "-S", "model.dropout=0", "-S", "train.seed=7",
                     "--report", "--batch", "b1", "--no-combine", "--out", "r2"]) == 0
    assert got == [tradeoffs.Request(got[0].cfg, "params.yaml", ("split", "packing"), report_only=True, batch="b1",
                                     combine=False, out_dir="r2", overrides=("model.dropout=0", "train.seed=7"))]
    assert (got[0].cfg.model.dropout, got[0].cfg.train.seed) == (0, 7)  # the overrides applied to cfg too


def test_tradeoffs_help_names_every_knob(capsys):
    """The description and --knobs come from tradeoffs/knobs.py's KNOBS (a hand-typed list missed
    padding_free and packing), each name whole (a comma-joined list wrapped mid-name)."""
    from onegpu import cli
    from onegpu.tradeoffs.knobs import KNOBS
    with pytest.raises(SystemExit) as stop:
        cli.main(["tradeoffs", "--help"])
    assert stop.value.code == 0
    description, options = " ".join(capsys.readouterr().out.split()).split(" options: ")
    knobs_help = options[options.index("--knobs LIST"):options.index("(default: all that apply")]
    for text in (description, knobs_help):
        assert set(KNOBS) <= set(re.findall(r"\w+", text)), text


def test_every_command_has_a_handler():
    from onegpu import cli
    [sub] = [a for a in cli._parser()._actions if a.dest == "command"]
    assert set(sub.choices) == set(cli.COMMANDS)


def test_tradeoffs_steps_and_full_exclude_each_other(tmp_path, monkeypatch, capsys):
    from onegpu import cli
    defaults.write_params(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["tradeoffs", "--steps", "4", "--full"]) == 2
    assert "--steps and --full exclude each other" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["estimate"], ["tradeoffs"]])
def test_a_grpo_run_is_not_estimated_or_traded_off_yet_in_one_line(tmp_path, monkeypatch, capsys, command):
    """A GRPO step's cost is mostly its generations', which neither command models: exit 2 before any work."""
    from onegpu import cli
    path = defaults.write_params(tmp_path)
    params = yaml.safe_load(path.read_text())
    params["model"]["task"], params["data"]["source"] = "grpo", "bbcnews-sections"
    params["train"]["per_device_train_batch_size"] = 8
    path.write_text(yaml.safe_dump(params))
    monkeypatch.chdir(tmp_path)
    assert cli.main(command) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"onegpu {command[0]}: error: model.task grpo is not measured by onegpu {command[0]} yet: a GRPO "
                   "step's time and memory are "
                   "mostly its generations' (sampled inside the step), which neither the estimate nor the tradeoffs "
                   "rows model; train with an integer train.per_device_train_batch_size and read the run's "
                   "generation_seconds and peak in MLflow"], err
