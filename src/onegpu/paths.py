"""Where things live: the project root, the MLflow store, the stage outputs.

DVC runs queued and ``--temp`` experiments in a temporary clone (``.dvc/tmp/exps/tmpXXXX``) that it
deletes afterwards, and sets ``DVC_ROOT`` to the user's repository in every stage process. Everything
that must outlive a stage (the MLflow store, its artifacts, the lock) is therefore resolved against
:func:`project_root`, never the current directory.
"""
from __future__ import annotations

import contextlib
import csv
import errno
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from onegpu.errors import DiskFullError

# Stage outputs, relative to the stage's working directory (the repo or DVC's temp clone).
PARAMS = Path("params.yaml")
PROCESSED = Path("data/processed")
STATS = Path("data/stats.json")
REFERENCE = Path("data/reference")  # DPO: the reference model's log-probabilities, scored once (reference stage)
TOKENIZER = PROCESSED / "tokenizer"  # causal-lm from config: the BPE tokenizer prepare trained
MODEL_DIR = Path("models/model")
ADAPTER_DIR = Path("models/adapter")  # model.lora: the LoRA adapter (MODEL_DIR holds the merged model)
RUN_FILE = Path("models/mlflow_run.json")
TRAIN_METRICS = Path("metrics/train.json")
EVAL_METRICS = Path("metrics/eval.json")
STEP_PLOT = Path("plots/train_steps.csv")
EVAL_PLOT = Path("plots/eval_steps.csv")  # one row per validation point (train.eval_strategy)
PREDICTIONS = Path("plots/predictions.csv")
GENERATIONS = Path("plots/generations.csv")  # instruction data: reference and generated answer per test row


DVC_LOCK = Path("dvc.lock")


def dvc_out_hash(out: str | os.PathLike, lock: str | os.PathLike = DVC_LOCK) -> str | None:
    """The hash DVC recorded for the stage output ``out`` (``data/processed``) in ``lock`` (its ``md5``,
    ``<hex>.dir`` for a folder), or None where the lock file or that output is not there (yet)."""
    import yaml
    try:
        stages = (yaml.safe_load(Path(lock).read_text()) or {}).get("stages", {})
    except (OSError, yaml.YAMLError):
        return None
    for stage in stages.values():
        for o in stage.get("outs", []) or []:
            if o.get("path") == str(out):
                return o.get("md5")
    return None


def dvc_version(out: str | os.PathLike = PROCESSED) -> str:
    """The DVC-tracked ``out`` at its recorded hash: ``data/processed@<md5>.dir`` (``dvc get``/``dvc exp
    apply`` bring that version back), or the path alone before DVC recorded it."""
    md5 = dvc_out_hash(out)
    return f"{out}@{md5}" if md5 else str(out)


def project_root(cwd: str | os.PathLike | None = None) -> Path:
    """The user's repository.

    ``DVC_ROOT`` when DVC set it (also in a queued experiment's temp clone, where it names the user's
    repo); else the nearest directory at or above ``cwd`` that holds ``.dvc/`` or ``.git/``; else ``cwd``.
    A temp clone under ``<root>/.dvc/tmp/exps/`` is mapped back to ``<root>`` as well.
    """
    env = os.environ.get("DVC_ROOT")
    if env:
        return _outside_exp_tmp(Path(env).resolve())
    here = Path(cwd or os.getcwd()).resolve()
    for d in (here, *here.parents):
        if (d / ".dvc").is_dir() or (d / ".git").exists():
            return _outside_exp_tmp(d)
    return here


def _outside_exp_tmp(p: Path) -> Path:
    parts = p.parts
    for i in range(len(parts) - 2):
        if parts[i:i + 3] == (".dvc", "tmp", "exps"):
            return Path(*parts[:i])
    return p


def params_differ_from_head(params: str | os.PathLike = PARAMS) -> bool:
    """Whether ``params`` (in the current directory) differs from its copy at git's ``HEAD``: what a
    ``dvc exp run -S`` in the workspace leaves there (DVC writes the values, and rewrites nulls as empty
    values, before any stage runs, and keeps them when a stage fails). One ``git diff --quiet`` (a few ms).

    False in DVC's temp clone of a queued or ``--temp`` experiment (the user's file is untouched there),
    outside git, or when git cannot answer within 5 s.
    """
    import subprocess
    here = Path.cwd().resolve()
    if _outside_exp_tmp(here) != here:
        return False
    try:
        # Outside a repository `git diff` falls back to comparing files (--no-index) and exits 1: ask first.
        if subprocess.run(["git", "rev-parse", "--verify", "-q", "HEAD"], capture_output=True,
                          timeout=5).returncode != 0:
            return False
        return subprocess.run(["git", "diff", "--quiet", "HEAD", "--", str(params)], capture_output=True,
                              timeout=5).returncode == 1
    except (OSError, subprocess.SubprocessError):
        return False


def tracking_uri(root: Path | None = None) -> str:
    """``MLFLOW_TRACKING_URI`` if set, else ``sqlite:///<root>/mlflow.db`` (absolute)."""
    if not uses_default_store():
        return os.environ["MLFLOW_TRACKING_URI"]
    return f"sqlite:///{(root or project_root()) / 'mlflow.db'}"


def uses_default_store() -> bool:
    """True unless ``MLFLOW_TRACKING_URI`` is set to a non-empty value."""
    return not os.environ.get("MLFLOW_TRACKING_URI")


def artifact_root(root: Path | None = None) -> Path:
    """``<root>/mlartifacts``: where a new experiment's artifacts go with the default SQLite store."""
    return (root or project_root()) / "mlartifacts"


def relative_to_root(path: str | os.PathLike) -> str:
    """``path`` relative to the project root when it lies inside it (what a user types there), else as given."""
    try:
        return str(Path(path).resolve().relative_to(project_root()))
    except ValueError:
        return str(path)


def checkpoint_dir(config_hash: str, root: Path | None = None) -> Path:
    """``<root>/.onegpu/checkpoints/<hash>``: resumable checkpoints of one training configuration.

    Outside every DVC output (DVC neither deletes nor caches a half-run) and outside DVC's temp clones,
    so a queued experiment interrupted in a clone resumes from the user's repo too.
    """
    return (root or project_root()) / ".onegpu" / "checkpoints" / config_hash


def spool_dir(root: Path | None = None) -> Path:
    """``<root>/.onegpu/spool``: MLflow writes waiting for an unreachable store (``onegpu sync``)."""
    return (root or project_root()) / ".onegpu" / "spool"


def lock_file(root: Path | None = None) -> Path:
    """A file lock that serialises creating the store and the experiment across processes."""
    d = (root or project_root()) / ".onegpu"
    d.mkdir(parents=True, exist_ok=True)
    return d / "tracking.lock"


# How writers report a full disk: the errno of an OSError, or the words of a library that wraps it
# (safetensors' "StorageFull", torch.save's "file write failed", SQLite's "database or disk is full").
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_FULL_WORDS = ("No space left on device", "StorageFull", "Disk quota exceeded", "database or disk is full",
               "file write failed")


def is_disk_full(error: BaseException) -> bool:
    """Whether ``error`` (or the error it was raised from) says the disk or the quota is full."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in _FULL_ERRNOS:
            return True
        if any(w in str(error) for w in _FULL_WORDS):
            return True
        error = error.__cause__ or error.__context__
    return False


def free_space(path: str | os.PathLike) -> str:
    """``"120 MiB free of 50.0 GiB on /data"``: the file system holding ``path`` (or its nearest existing parent)."""
    from onegpu.formatting import size
    p = Path(path).resolve()
    while not p.exists() and p != p.parent:
        p = p.parent
    usage = shutil.disk_usage(p)
    mount = p
    while not os.path.ismount(mount) and mount != mount.parent:
        mount = mount.parent
    return f"{size(usage.free)} free of {size(usage.total)} on {mount}"


@contextlib.contextmanager
def writing(path) -> Iterator[None]:
    """Around writing ``path`` (a path, or a function returning it, called only on a full disk): a full
    disk, in whatever words the writer reports it (:func:`is_disk_full`), becomes one
    :class:`~onegpu.errors.DiskFullError` naming ``path`` and the free space; any other error passes unchanged.

    Raises:
        DiskFullError: the disk or the quota is full.
    """
    try:
        yield
    except DiskFullError:
        raise
    except Exception as e:
        if not is_disk_full(e):
            raise
        raise disk_full(path() if callable(path) else path) from e


def disk_full(path: str | os.PathLike) -> DiskFullError:
    """The one error for a full disk while writing ``path`` (a local path, or a URI on a server): the
    path and, for a local one, the free space; what to do."""
    where = str(path) if "://" in str(path) or str(path).startswith("mlflow-artifacts:") else \
        f"{relative_to_root(path)} ({free_space(path)})"
    return DiskFullError(f"no space left on the device writing {where}: "
                         "free some space and run the same command again (a stopped training resumes from its "
                         "newest complete checkpoint)")


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, newline: str | None = None) -> Iterator[TextIO]:
    """Write a text file atomically: yields a file open for writing at a temporary name next to ``path``;
    when the block ends without an error it is renamed over ``path`` (mode 0644), else removed. Readers
    (and DVC) never see a half-written file. The parent folder is created.

    Raises:
        DiskFullError: the disk is full (:func:`writing`)."""
    path = Path(path)
    with writing(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        try:
            with os.fdopen(fd, "w", newline=newline) as f:
                yield f
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Write a folder atomically: yields an empty temporary folder next to ``path``; when the block ends
    without an error the old ``path`` is removed and the new one moved into its place, else the temporary
    folder is removed.

    Raises:
        DiskFullError: the disk is full (:func:`writing`)."""
    path = Path(path)
    with writing(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}-"))
        try:
            yield tmp
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        shutil.rmtree(path, ignore_errors=True)
        shutil.move(str(tmp), str(path))


def write_json_atomic(path: str | os.PathLike, obj) -> None:
    """Write JSON to ``path`` (indented, sorted keys) through :func:`atomic_file`."""
    with atomic_file(path) as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")


def write_csv_atomic(path: str | os.PathLike, header: list[str], rows) -> None:
    """Write a CSV file (``header``, then ``rows`` as sequences) through :func:`atomic_file`."""
    with atomic_file(path, newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)


def read_json(path: str | os.PathLike):
    with open(path) as f:
        return json.load(f)


def only_in_user_repo(path: str | os.PathLike) -> Path | None:
    """The user's copy of a relative ``path`` that is missing here because DVC runs this stage in a
    queued or ``--temp`` experiment's clone (which holds only files git or DVC track); else None.

    None also when ``path`` is absolute, exists here, or the current directory is the project root.
    """
    p = Path(path).expanduser()
    if p.is_absolute() or p.exists():
        return None
    here, root = Path.cwd().resolve(), project_root()
    if here == root or not (root / p).exists():
        return None
    return root / p
