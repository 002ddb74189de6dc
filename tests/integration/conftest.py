"""Real `dvc` runs in a temporary copy of this repository with a tiny config.

The copy holds the files git knows (tracked, or new and not ignored), committed in a fresh git repo,
so DVC experiments (which need commits) work as they would in a user's clone.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests import defaults

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent

# A few dozen examples, a few optimizer steps: seconds per stage on a 2-core CPU.
TINY = {
    "data": {"max_train_samples": 24, "max_eval_samples": 16, "max_length": 32},
    "model": {"dropout": 0.0},
    "train": {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "max_steps": 3,
              "logging_steps": 1},
}


def _env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MLFLOW_", "DVC_")) and k not in ("VIRTUAL_ENV",)}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["GIT_AUTHOR_NAME"] = env["GIT_COMMITTER_NAME"] = "onegpu-test"
    env["GIT_AUTHOR_EMAIL"] = env["GIT_COMMITTER_EMAIL"] = "test@example.invalid"
    return env


def run(cmd: list[str], cwd: Path, timeout: int = 600, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {p.returncode}\nstdout:\n{p.stdout[-4000:]}\n"
                             f"stderr:\n{p.stderr[-4000:]}")
    return p


def dvc(project: Path, *args: str, **kw) -> subprocess.CompletedProcess:
    return run([str(BIN / "dvc"), *args], cwd=project, **kw)


def make_project(dest: Path, overrides: dict | None = None) -> Path:
    """Copy the repo's files into ``dest``, apply TINY (+ ``overrides``) to the committed params.yaml, git commit."""
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, text=True, check=True).stdout.split()
    for f in files:
        src = REPO / f
        if src.is_file() and not f.startswith(("tests/", "bench/", "metrics/", "plots/", "data/stats.json",
                                               "data/inputs/")):
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / f)
    (dest / "dvc.lock").unlink(missing_ok=True)  # a developer's earlier run
    params = defaults.params()  # the committed defaults, whatever `dvc exp run` left in the workspace
    for section, values in {**TINY, **(overrides or {})}.items():
        params[section].update(values)
    (dest / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    run(["git", "init", "-q", "-b", "main"], dest)
    run(["git", "add", "-A"], dest)
    run(["git", "commit", "-qm", "tiny project"], dest)
    return dest


def wait_for_queue(project: Path, timeout: float = 900) -> str:
    """Poll `dvc queue status` until nothing is queued or running; return the last status text."""
    deadline = time.monotonic() + timeout
    while True:
        out = dvc(project, "queue", "status").stdout
        if not any(w in out for w in ("Queued", "Running")):
            return out
        if time.monotonic() > deadline:
            raise AssertionError(f"queue still busy after {timeout} s:\n{out}")
        time.sleep(3)


def client(project: Path):
    from mlflow import MlflowClient
    db = project / "mlflow.db"
    assert db.is_file(), f"no MLflow store at {db}"
    return MlflowClient(tracking_uri=f"sqlite:///{db}")


def runs(project: Path, experiment: str = "onegpu"):
    c = client(project)
    exp = c.get_experiment_by_name(experiment)
    assert exp is not None, f"no experiment {experiment!r}"
    return c, exp, c.search_runs([exp.experiment_id], max_results=1000)


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """A tiny project on which `dvc repro` has run once."""
    p = make_project(tmp_path_factory.mktemp("project"))
    result = dvc(p, "repro")
    p.joinpath("repro.log").write_text(result.stdout + result.stderr)
    run(["git", "add", "-A"], p)
    run(["git", "commit", "-qm", "repro"], p)
    return p
