"""The committed defaults that tests build their projects from, never the workspace's ``params.yaml``.

``dvc exp run -S key=value`` writes its values into the workspace ``params.yaml`` (DVC applies an
experiment to the workspace), and a user may edit it by hand: a test that read that file would test the
user's last experiment, not the project's defaults. Every test reads ``params.yaml`` as committed at
``HEAD`` (``git show HEAD:params.yaml``); outside a git checkout (an unpacked source archive) the file
itself is all there is.
"""
from __future__ import annotations

import subprocess
from functools import cache
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


@cache
def params_text(repo: Path = REPO) -> str:
    """``params.yaml`` of ``repo`` as committed at HEAD (text); the file itself outside git."""
    try:
        return subprocess.run(["git", "show", "HEAD:params.yaml"], cwd=repo, capture_output=True, text=True,
                              check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return (repo / "params.yaml").read_text()


def params(repo: Path = REPO) -> dict:
    """The committed defaults as a fresh, mutable dict."""
    return yaml.safe_load(params_text(repo))


def write_params(dest: Path, repo: Path = REPO) -> Path:
    """Write the committed ``params.yaml`` (comments kept) to ``dest`` (a file or a directory)."""
    dest = dest / "params.yaml" if dest.is_dir() else dest
    dest.write_text(params_text(repo))
    return dest
