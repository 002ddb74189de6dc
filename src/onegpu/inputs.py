"""What ``params.yaml`` names, made paths DVC hashes: ``data/inputs/data.source`` and
``data/inputs/model.name_or_path``.

``data.source`` and ``model.name_or_path`` may name a package (``bbcnews``, ``packaged:...``), a file, a
directory, a hub id or nothing. DVC's own way to re-run a stage when its data changes is a dependency on
the data's path, but a ``dvc.yaml`` dependency must exist before the stage runs and ``dvc.yaml`` has no
conditionals, so a template such as ``deps: [${data.source}]`` fails for a package name, a hub id or
null. The ``inputs`` stage (:func:`link`) therefore makes one link per param, named after it, to what
the param names (DVC follows links when it hashes), and prepare and train depend on the links:

- a file or directory: a link to it (relative when it lies inside the project, so DVC's clone of a
  queued experiment links its own copy);
- a package (the BBC corpus, a packaged model): a link to its installed data folder;
- a hub id: a link to ``refs/main`` of its local Hugging Face cache entry (the commit a download
  brought; a newer download changes it), or, with no cache entry, a small file naming the id;
- null (a causal LM built from config): a small file saying so.

So ``dvc status`` names prepare or train exactly when the content behind a link changed (DVC hashes
it, and keeps the hashes by inode and mtime in its state database), and the stage re-runs only when
the params change or a link is missing (a fresh clone, DVC's clone of a queued experiment). dvc.lock
records each input's content hash, so a commit records which data and model were used.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from onegpu.config import Config, DataConfig
from onegpu.data import files
from onegpu.errors import ModelError
from onegpu.models import loader

LINKS = Path("data/inputs")
DATA_LINK = LINKS / "data.source"
MODEL_LINK = LINKS / "model.name_or_path"


def data_target(source: str) -> Path:
    """The path ``data.source`` names: the packaged corpus's installed folder, or the file or folder.

    Raises:
        DataError: as :func:`onegpu.data.files.check_source` (missing, not tracked in a queued experiment's
            clone, wrong kind of file).
    """
    files.check_source(DataConfig(source=source))
    if files.source_kind(source) == "package":
        return files.bbcnews_dir()
    return Path(source).expanduser()


def model_target(name_or_path: str | None) -> Path | dict:
    """The path ``model.name_or_path`` names (packaged or local directory; a hub id's ``refs/main`` in
    the local HF cache), or, where nothing local stands for it, the description a small file records.

    Raises:
        ModelError: as :func:`onegpu.models.loader.resolve_model_path`, or a local directory that exists in the
            user's repository but not in a queued experiment's clone (not tracked by git or DVC).
    """
    if name_or_path is None:
        return {"model.name_or_path": None, "kind": "built from config (model.n_layer, n_embd, n_head)"}
    from onegpu.models import packaged
    if name_or_path in packaged.GGUF:  # the package's GGUF file, not its cached conversion (none is made here)
        return packaged.package_dir(name_or_path) / packaged.GGUF[name_or_path][1]
    untracked = files.untracked_in_clone("model.name_or_path", name_or_path, f"`dvc add {name_or_path}`")
    if untracked:
        raise ModelError(untracked)
    resolved = loader.resolve_model_path(name_or_path)
    if Path(resolved).is_dir():
        return Path(resolved)
    ref = _cached_ref(name_or_path)
    return ref if ref is not None else {"model.name_or_path": name_or_path,
                                        "kind": "hub id, not in the local Hugging Face cache when linked"}


def _cached_ref(repo_id: str) -> Path | None:
    """``<HF cache>/models--<org>--<name>/refs/main`` when that file exists, else None."""
    try:
        from huggingface_hub.constants import HF_HUB_CACHE
    except Exception:
        return None
    ref = Path(HF_HUB_CACHE) / f"models--{repo_id.replace('/', '--')}" / "refs" / "main"
    return ref if ref.is_file() else None


def _place(link: Path, target: Path | dict) -> None:
    """Make ``link`` a symlink to ``target`` (a dict: a small JSON file), atomically (a temp name, then
    ``os.replace``): a reader never sees it missing. A target inside the working directory is linked
    by a relative path."""
    link.parent.mkdir(parents=True, exist_ok=True)
    tmp = link.with_name(f".{link.name}.tmp")
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    if isinstance(target, dict):
        tmp.write_text(json.dumps(target, indent=1) + "\n")
    else:
        absolute = target.resolve()
        here = Path.cwd().resolve()
        inside = absolute == here or here in absolute.parents
        tmp.symlink_to(os.path.relpath(absolute, link.parent.resolve()) if inside else absolute,
                       target_is_directory=absolute.is_dir())
    os.replace(tmp, link)


def link(cfg: Config) -> dict[str, str]:
    """Point :data:`DATA_LINK` and :data:`MODEL_LINK` at what ``cfg`` names (in the current directory:
    the project, or DVC's clone). Returns ``{param: what it links to}`` for the stage's line.

    Raises:
        DataError, ModelError: as :func:`data_target` and :func:`model_target`, before any link changes.
    """
    targets = {DATA_LINK: data_target(cfg.data.source), MODEL_LINK: model_target(cfg.model.name_or_path)}
    for path, target in targets.items():
        _place(path, target)
    return {p.name: (t["kind"] if isinstance(t, dict) else os.readlink(p)) for p, t in targets.items()}
