"""Real `dvc` runs in a temporary copy of this repository with a tiny config.

The copy holds the files git knows (tracked, or new and not ignored), committed in a fresh git repo,
so DVC experiments (which need commits) work as they would in a user's clone.

Cheap patterns (tests/README.md, "Keeping the suite fast"): a test that needs prepared data but does not
test `prepare` itself takes the ``prepared`` fixture: ``prepared(tmp_path, overrides)`` is a copy of a
project on which `dvc repro prepare` ran once per session for those params (git history, dvc.lock and
the DVC cache copied, not re-run); ``trained(tmp_path, overrides)`` likewise a copy of a project on which
`dvc repro` ran once per session for those params. Several assertions on one pipeline run share one run (the
module fixture ``project``, a copy of ``trained``, or one test that checks several things in sequence), not
one run each.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
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


def run(cmd: list[str], cwd: Path, timeout: int = 600, check: bool = True,
        env: dict | None = None) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, cwd=cwd, env=env or _env(), capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {p.returncode}\nstdout:\n{p.stdout[-4000:]}\n"
                             f"stderr:\n{p.stderr[-4000:]}")
    return p


def dvc(project: Path, *args: str, **kw) -> subprocess.CompletedProcess:
    return run([str(BIN / "dvc"), *args], cwd=project, **kw)


def set_train(project: Path, **train) -> None:
    """Update ``train`` keys in ``project``'s params.yaml (the rest as it is)."""
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["train"].update(train)
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


def tiny_params(overrides: dict | None = None) -> dict:
    """The committed defaults with TINY, then ``overrides``, applied section by section."""
    params = defaults.params()  # the committed defaults, whatever `dvc exp run` left in the workspace
    for section, values in {**TINY, **(overrides or {})}.items():
        params[section].update(values)
    return params


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
    (dest / "params.yaml").write_text(yaml.safe_dump(tiny_params(overrides), sort_keys=False))
    run(["git", "init", "-q", "-b", "main"], dest)
    run(["git", "add", "-A"], dest)
    run(["git", "commit", "-qm", "tiny project"], dest)
    return dest


# What a copy leaves out: onegpu's per-project state (locks, spool, checkpoints) and DVC's per-machine state.
_NOT_COPIED = {".": {".onegpu", "mlflow.db-journal"}, ".dvc": {"tmp"}}


def copy_project(src: Path, dest: Path, overrides: dict | None = None) -> Path:
    """Copy project ``src`` to ``dest`` (an empty or missing folder) as if its commands had run there: git
    history, dvc.lock, DVC cache and outputs (links kept as links), the MLflow store with its artifact
    locations moved to ``dest``; not .onegpu or .dvc/tmp. With ``overrides``, params.yaml becomes TINY +
    ``overrides`` (committed when it changed)."""
    src, dest = Path(src), Path(dest)

    def ignore(folder: str, names: list[str]) -> set[str]:
        return _NOT_COPIED.get(Path(folder).relative_to(src).as_posix(), set()) & set(names)
    shutil.copytree(src, dest, symlinks=True, ignore=ignore, dirs_exist_ok=True)
    if (dest / "mlflow.db").is_file():
        import sqlite3
        db = sqlite3.connect(dest / "mlflow.db")
        with db:  # the only columns of MLflow's schema that hold the project's path
            for table, column in (("experiments", "artifact_location"), ("runs", "artifact_uri")):
                db.execute(f"UPDATE {table} SET {column} = replace({column}, ?, ?)", (str(src), str(dest)))
        db.close()
    if overrides is not None:
        (dest / "params.yaml").write_text(yaml.safe_dump(tiny_params(overrides), sort_keys=False))
        if run(["git", "status", "--porcelain"], dest).stdout.strip():
            run(["git", "commit", "-qam", "test params"], dest)
    return dest


def _prepare_key(params: dict) -> str:
    """The values of the params dvc.yaml's inputs and prepare stages read, as one string."""
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    picked = {}
    for key in (*stages["inputs"]["params"], *stages["prepare"]["params"]):
        section, _, name = key.partition(".")
        picked[key] = params.get(section) if not name else (params.get(section) or {}).get(name)
    return json.dumps(picked, sort_keys=True, default=str)


class Prepared:
    """``prepared(dest, overrides=None)``: a copy (:func:`copy_project`) at ``dest`` of a tiny project with
    TINY + ``overrides`` on which `dvc repro prepare` ran and was committed (its MLflow store holds the
    prepare run). The original is built once per session for each value of the params prepare depends on
    (dvc.yaml), shared by the xdist workers (a file lock), and never changed; ``output(overrides)`` is what
    its `dvc repro prepare` printed."""

    def __init__(self, shared: Path) -> None:
        self.shared = shared

    def _base(self, overrides: dict | None) -> Path:
        key = hashlib.sha256(_prepare_key(tiny_params(overrides)).encode()).hexdigest()[:12]

        def build(base: Path) -> str:
            make_project(base, overrides)
            return dvc(base, "repro", "prepare").stdout
        return _built_once(self.shared / f"prepared-{key}", build, "prepared")

    def __call__(self, dest: Path, overrides: dict | None = None) -> Path:
        return copy_project(self._base(overrides), dest, overrides or {})

    def output(self, overrides: dict | None = None) -> str:
        return _log(self._base(overrides)).read_text()


def _log(base: Path) -> Path:
    return base.with_name(base.name + ".log")


def _built_once(base: Path, build: Callable[[Path], str], message: str) -> Path:
    """``base`` (a project folder shared by the xdist workers) built once per session: under a file lock,
    unless ``<base>.log`` says it is complete, ``build(base)`` fills the empty folder and returns what its
    `dvc` command printed; the project is then committed (``message``) and the output kept in ``<base>.log``."""
    from filelock import FileLock
    with FileLock(str(base) + ".lock"):
        if not _log(base).is_file():
            shutil.rmtree(base, ignore_errors=True)
            base.mkdir()
            out = build(base)
            run(["git", "add", "-A"], base)
            run(["git", "commit", "-qm", message], base)
            _log(base).write_text(out)
    return base


@pytest.fixture(scope="session")
def prepared(tmp_path_factory) -> Prepared:
    """See :class:`Prepared`."""
    base = tmp_path_factory.getbasetemp()
    return Prepared(base.parent if "PYTEST_XDIST_WORKER" in os.environ else base)  # one folder for all workers


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


class Trained:
    """``trained(dest, overrides=None)``: a copy (:func:`copy_project`) at ``dest`` of a tiny project with
    TINY + ``overrides`` on which `dvc repro` ran and was committed (prepare in ``prepared``'s original,
    train and evaluate here; its MLflow store holds the prepare run and one FINISHED training run). The
    original is built once per session for each ``overrides``, shared by the xdist workers (a file lock),
    and never changed."""

    def __init__(self, prepared: Prepared) -> None:
        self.prepared = prepared

    def _base(self, overrides: dict | None) -> Path:
        def build(base: Path) -> str:
            self.prepared(base, overrides)
            return dvc(base, "repro").stdout
        name = "trained" if overrides is None else "trained-" + hashlib.sha256(
            json.dumps(tiny_params(overrides), sort_keys=True, default=str).encode()).hexdigest()[:12]
        return _built_once(self.prepared.shared / name, build, "repro")

    def __call__(self, dest: Path, overrides: dict | None = None) -> Path:
        return copy_project(self._base(overrides), dest)


@pytest.fixture(scope="session")
def trained(prepared) -> Trained:
    """See :class:`Trained`."""
    return Trained(prepared)


FAULTS = Path(__file__).with_name("faults")  # sitecustomize.py: ONEGPU_TEST_FAULT, ONEGPU_TEST_DTYPE


def float64_env(**more: str) -> dict:
    """The environment of a test's commands, torch's default dtype float64 from start-up (the faults folder's
    ``ONEGPU_TEST_DTYPE``) and ``more`` (e.g. ``ONEGPU_TEST_FAULT``)."""
    env = _env()
    env.update(ONEGPU_TEST_DTYPE="float64", PYTHONPATH=os.pathsep.join(filter(None, [str(FAULTS),
                                                                                     env.get("PYTHONPATH")])), **more)
    return env


# The data-parallel tests' causal LM: a 2-layer GPT-2 from config whose micro-batches pad to their own longest row.
CAUSAL_LM = {
    "data": {"max_train_samples": 32, "max_eval_samples": 16, "max_length": 48},
    "model": {"task": "causal-lm", "name_or_path": None, "n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 512,
              "dropout": 0.0},
}
# Its training of 8 examples a step that every split is compared with (processes, machines, sharding, a resume).
SPLIT_REFERENCE = {"num_processes": 1, "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1,
                   "learning_rate": 1e-3, "logging_steps": 1, "max_steps": 4, "backend": "trainer"}


class Float64Reference:
    """``float64_reference()``: what MLflow holds of :data:`CAUSAL_LM` trained by `onegpu train` as
    :data:`SPLIT_REFERENCE` (one process, 8 x 1 on HF Trainer, 4 optimizer steps) in float64 from start-up: the
    per-step ``loss``, ``grad_norm`` and ``step_tokens`` (lists by step) and its ``equivalence_key``. Two processes,
    two machines, sharding and a resume on another split train the same 8 examples a step and must log these within
    1e-12 (float64 leaves only the summation order). Trained once per session, shared by the xdist workers (a file
    lock), in a project no test changes."""

    def __init__(self, prepared: Prepared) -> None:
        self.prepared = prepared

    def __call__(self) -> dict:
        def build(base: Path) -> str:
            self.prepared(base, CAUSAL_LM)
            set_train(base, **SPLIT_REFERENCE)
            run([str(BIN / "onegpu"), "train"], cwd=base, env=float64_env())
            c, _, all_runs = runs(base)
            (train,) = [r for r in all_runs if r.data.tags.get("stage") == "train"]
            return json.dumps({"equivalence_key": train.data.tags["equivalence_key"],
                               **{k: series(c, train.info.run_id, k) for k in ("loss", "grad_norm", "step_tokens")}})
        return json.loads(_log(_built_once(self.prepared.shared / "float64-reference", build, "train")).read_text())


@pytest.fixture(scope="session")
def float64_reference(prepared) -> Float64Reference:
    """See :class:`Float64Reference`."""
    return Float64Reference(prepared)


def series(client, run_id: str, key: str) -> list[float]:
    """MLflow's values of ``key`` in ``run_id`` by step, one per step (a resumed run logs its restored steps
    again)."""
    return [v for _, v in sorted({m.step: m.value for m in client.get_metric_history(run_id, key)}.items())]


def assert_reference_steps(client, run, ref: dict, rel: float = 1e-12) -> None:
    """MLflow run ``run`` logged ``ref``'s (:class:`Float64Reference`) loss and grad_norm of every step within
    ``rel`` relative, by step (a resumed run logs its restored steps again), and as many steps."""
    for key in ("loss", "grad_norm"):
        got, want = series(client, run.info.run_id, key), ref[key]
        assert len(got) == len(want), (key, got, want)
        assert max(abs(a - b) / abs(b) for a, b in zip(got, want)) <= rel, (key, got, want)


@pytest.fixture(scope="module")
def project(tmp_path_factory, trained) -> Path:
    """A copy of ``trained``'s project, for one module's tests in order."""
    return trained(tmp_path_factory.mktemp("project"))
