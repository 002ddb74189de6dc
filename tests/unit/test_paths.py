"""Project root (also from DVC's temp clones), the MLflow store's URI, atomic JSON writes."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from onegpu import paths


@pytest.fixture
def repo(tmp_path, monkeypatch) -> Path:
    """A user repository with .dvc/ and a DVC temp clone inside it; no DVC_ROOT or MLFLOW_TRACKING_URI."""
    monkeypatch.delenv("DVC_ROOT", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    root = (tmp_path / "repo").resolve()
    (root / ".dvc").mkdir(parents=True)
    clone = root / ".dvc" / "tmp" / "exps" / "tmpabc"
    (clone / ".dvc").mkdir(parents=True)  # a temp clone is a repo of its own
    (clone / "src").mkdir()
    return root


def _clone(root: Path) -> Path:
    return root / ".dvc" / "tmp" / "exps" / "tmpabc"


# -- project_root --------------------------------------------------------------------------------

def test_project_root_honours_dvc_root(repo, tmp_path, monkeypatch):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.setenv("DVC_ROOT", str(repo))
    assert paths.project_root() == repo
    assert paths.project_root(cwd=elsewhere) == repo  # DVC_ROOT wins over the cwd


def test_project_root_maps_dvc_root_in_temp_clone_back(repo, monkeypatch):
    monkeypatch.setenv("DVC_ROOT", str(_clone(repo)))
    assert paths.project_root() == repo


def test_project_root_maps_cwd_in_temp_clone_back(repo, monkeypatch):
    monkeypatch.chdir(_clone(repo) / "src")
    assert paths.project_root() == repo
    assert paths.project_root(cwd=_clone(repo)) == repo


def test_project_root_finds_nearest_dvc_dir(repo, monkeypatch):
    deep = repo / "a" / "b"
    deep.mkdir(parents=True)
    monkeypatch.chdir(deep)
    assert paths.project_root() == repo
    assert paths.project_root(cwd=deep) == repo
    assert paths.project_root(cwd=repo) == repo


def test_project_root_nearest_wins_over_outer(repo):
    inner = repo / "sub" / "inner"
    (inner / ".dvc").mkdir(parents=True)
    assert paths.project_root(cwd=inner / ".") == inner


def test_project_root_without_marker_is_cwd(tmp_path, monkeypatch):
    monkeypatch.delenv("DVC_ROOT", raising=False)
    here = tmp_path / "plain"
    here.mkdir()
    if any((d / ".dvc").is_dir() or (d / ".git").exists() for d in here.resolve().parents):
        pytest.skip("tmp_path lies inside a repository")
    assert paths.project_root(cwd=here) == here.resolve()


# -- tracking_uri / artifact_root ----------------------------------------------------------------

def test_tracking_uri_default_is_absolute_sqlite_in_root(repo, monkeypatch):
    monkeypatch.setenv("DVC_ROOT", str(repo))
    uri = paths.tracking_uri()
    assert uri == f"sqlite:///{repo}/mlflow.db"
    assert Path(uri[len("sqlite:///"):]).is_absolute()
    assert paths.tracking_uri(repo) == uri


def test_tracking_uri_from_temp_clone_points_at_user_repo(repo, monkeypatch):
    monkeypatch.chdir(_clone(repo))
    assert paths.tracking_uri() == f"sqlite:///{repo}/mlflow.db"
    assert paths.artifact_root() == repo / "mlartifacts"


def test_tracking_uri_env_wins(repo, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5999")
    assert paths.tracking_uri() == "http://127.0.0.1:5999"
    assert paths.tracking_uri(repo) == "http://127.0.0.1:5999"


def test_lock_file_is_in_project_root(repo):
    lock = paths.lock_file(repo)
    assert lock.parent == repo / ".onegpu"
    assert lock.parent.is_dir()


# -- write_json_atomic ---------------------------------------------------------------------------

def test_write_json_atomic_writes_valid_json_and_no_temp(tmp_path):
    target = tmp_path / "out" / "metrics.json"
    obj = {"loss": 0.5, "steps": [1, 2, 3], "name": "ü"}
    paths.write_json_atomic(target, obj)
    assert json.loads(target.read_text()) == obj
    assert paths.read_json(target) == obj
    assert sorted(p.name for p in target.parent.iterdir()) == ["metrics.json"]
    # overwrite
    paths.write_json_atomic(target, {"loss": 0.25})
    assert paths.read_json(target) == {"loss": 0.25}
    assert os.listdir(target.parent) == ["metrics.json"]


def test_write_json_atomic_failure_leaves_no_temp(tmp_path):
    target = tmp_path / "m.json"
    paths.write_json_atomic(target, {"ok": 1})
    with pytest.raises(TypeError):
        paths.write_json_atomic(target, {"bad": object()})
    assert paths.read_json(target) == {"ok": 1}  # the old file survives
    assert os.listdir(tmp_path) == ["m.json"]


# -- atomic_file / atomic_dir / write_csv_atomic -------------------------------------------------

def test_atomic_file_and_dir_replace_on_success_and_leave_the_old_output_on_error(tmp_path):
    target = tmp_path / "plots" / "steps.csv"
    paths.write_csv_atomic(target, ["step", "loss"], [(1, 0.5), (2, None)])
    assert target.read_bytes() == b"step,loss\r\n1,0.5\r\n2,\r\n"
    with pytest.raises(RuntimeError):
        with paths.atomic_file(target) as f:
            f.write("half")
            raise RuntimeError("cut off")
    assert target.read_bytes() == b"step,loss\r\n1,0.5\r\n2,\r\n"  # the old file, whole
    folder = tmp_path / "models" / "model"
    with paths.atomic_dir(folder) as tmp:
        (tmp / "a.txt").write_text("1")
    with pytest.raises(RuntimeError):
        with paths.atomic_dir(folder) as tmp:
            (tmp / "b.txt").write_text("2")
            raise RuntimeError("cut off")
    assert sorted(p.name for p in folder.iterdir()) == ["a.txt"]
    with paths.atomic_dir(folder) as tmp:
        (tmp / "c.txt").write_text("3")
    assert sorted(p.name for p in folder.iterdir()) == ["c.txt"]  # replaced, not merged
    # no temporary file or folder is left next to the outputs
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == ["steps.csv"]
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["model"]


# -- a full disk ----------------------------------------------------------------------------------

@pytest.mark.parametrize("error", [
    OSError(28, "No space left on device"),  # errno.ENOSPC, as open/write raise it
    OSError(122, "Disk quota exceeded"),  # errno.EDQUOT
    RuntimeError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left" })'),
    RuntimeError("[enforce fail at inline_container.cc:626] . PytorchStreamWriter failed writing file data/0: "
                 "file write failed"),  # torch.save
])
def test_a_full_disk_in_any_writers_words_is_one_error_naming_the_path_and_the_free_space(tmp_path, error):
    from onegpu.errors import DiskFullError
    target = tmp_path / "out" / "model.safetensors"  # its folder does not exist: the free space is its parent's
    with pytest.raises(DiskFullError) as e:
        with paths.writing(target):
            raise error
    text = str(e.value)
    assert text.startswith(f"no space left on the device writing {target} (") and " free of " in text
    assert e.value.__cause__ is error


def test_other_write_errors_pass_unchanged(tmp_path):
    with pytest.raises(PermissionError):
        with paths.writing(tmp_path / "x"):
            raise PermissionError(13, "Permission denied")


def test_atomic_writes_leave_no_half_file_on_a_full_disk(tmp_path):
    from onegpu.errors import DiskFullError
    target = tmp_path / "metrics.json"
    target.write_text("old")
    with pytest.raises(DiskFullError):
        with paths.atomic_file(target) as f:
            f.write("{")
            raise OSError(28, "No space left on device")
    assert target.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["metrics.json"]


def test_dvc_version_names_the_output_at_the_hash_dvc_lock_records(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert paths.dvc_out_hash("data/processed") is None and paths.dvc_version() == "data/processed"  # no lock yet
    (tmp_path / "dvc.lock").write_text(
        "schema: '2.0'\nstages:\n  prepare:\n    cmd: onegpu prepare\n    outs:\n"
        "    - path: data/stats.json\n      hash: md5\n      md5: 0123\n"
        "    - path: data/processed\n      hash: md5\n      md5: f4d782aab4dd724956fbb541cddc5d95.dir\n")
    assert paths.dvc_out_hash("data/processed") == "f4d782aab4dd724956fbb541cddc5d95.dir"
    assert paths.dvc_version() == "data/processed@f4d782aab4dd724956fbb541cddc5d95.dir"
    assert paths.dvc_out_hash("models") is None
    (tmp_path / "dvc.lock").write_text("stages: [unclosed")
    assert paths.dvc_out_hash("data/processed") is None  # a lock DVC is rewriting: no version, no failure
