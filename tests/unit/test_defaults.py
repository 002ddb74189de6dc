"""Tests build their projects from the committed params.yaml, never from the edited workspace copy."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests import defaults

# What `dvc exp run -S train.per_device_train_batch_size=auto -S train.effective_batch_size=32
# -S train.memory_budget_gib=0.8` (the README's example) leaves in the workspace params.yaml.
README_EXP = {"per_device_train_batch_size": "auto", "effective_batch_size": 32, "memory_budget_gib": 0.8}


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout


def _edit_like_dvc_exp_run(params: Path) -> None:
    d = yaml.safe_load(params.read_text())
    d["train"].update(README_EXP)
    params.write_text(yaml.safe_dump(d, sort_keys=False))


def test_defaults_come_from_head_not_the_workspace_file(tmp_path):
    repo = tmp_path / "r"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "params.yaml").write_text("train:\n  per_device_train_batch_size: 8  # micro-batch\n")
    _git(repo, "add", "params.yaml")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "defaults")
    _edit_like_dvc_exp_run(repo / "params.yaml")
    assert yaml.safe_load((repo / "params.yaml").read_text())["train"]["per_device_train_batch_size"] == "auto"
    assert defaults.params(repo) == {"train": {"per_device_train_batch_size": 8}}
    out = defaults.write_params(tmp_path, repo)
    assert out.read_text().endswith("8  # micro-batch\n")  # comments kept


@pytest.mark.slow
def test_suite_passes_on_a_workspace_edited_by_dvc_exp_run(tmp_path):
    """Clone the repo, edit its params.yaml as the README's `dvc exp run` does, and run two test files
    that read the defaults there through both of tests/defaults.py's readers (``params``,
    ``write_params``; every test that reads the defaults goes through one of them), plus the integration
    projects' builder: all must pass on the committed defaults."""
    clone = tmp_path / "clone"
    _git(defaults.REPO, "clone", "-q", "--no-hardlinks", str(defaults.REPO), str(clone))
    _edit_like_dvc_exp_run(clone / "params.yaml")
    env = {**os.environ, "PYTHONPATH": f"{clone / 'src'}{os.pathsep}{clone}"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow",
         "tests/unit/config", "tests/unit/test_cli.py"],
        cwd=clone, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    code = ("import sys, yaml, pathlib, tempfile; from tests.integration.conftest import make_project; "
            "p = make_project(pathlib.Path(tempfile.mkdtemp(dir=sys.argv[1]))); "
            "print(yaml.safe_load((p / 'params.yaml').read_text())['train']['per_device_train_batch_size'])")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=clone, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "4"  # TINY's micro-batch over the committed 8, not the workspace's 'auto'
