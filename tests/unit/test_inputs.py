"""The links of onegpu.inputs: data/inputs/<param> points at what data.source and model.name_or_path
name (DVC hashes through them); relative inside the project, a small file where nothing local exists.
Real `dvc status` / `dvc repro` on them: tests/integration/test_inputs.py."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from onegpu import config, data, inputs
from onegpu.errors import ModelError
from onegpu.models import loader


def _cfg(source: str = "bbcnews", model: str | None = "packaged:all-MiniLM-L6-v2", task: str | None = None):
    m = {"name_or_path": model, **({"task": task} if task else {})}
    return config.from_container({"data": {"source": source}, "model": m})


def test_a_file_in_the_project_is_linked_relatively_and_relinked_when_the_param_changes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d.csv").write_text("text,label\na,1\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "e.jsonl").write_text('{"text": "a", "label": "1"}\n')
    found = inputs.link(_cfg("d.csv"))
    assert os.readlink(inputs.DATA_LINK) == found["data.source"] == "../../d.csv"
    assert inputs.DATA_LINK.read_text() == "text,label\na,1\n"  # what DVC hashes: the file's content
    inputs.link(_cfg("sub/e.jsonl"))
    assert os.readlink(inputs.DATA_LINK) == "../../sub/e.jsonl"
    assert sorted(p.name for p in inputs.LINKS.iterdir()) == ["data.source", "model.name_or_path"]  # no temp left


def test_a_folder_outside_the_project_is_linked_absolutely(tmp_path, monkeypatch):
    project, outside = tmp_path / "p", tmp_path / "texts"
    project.mkdir()
    (outside / "a").mkdir(parents=True)
    (outside / "a" / "1.txt").write_text("one")
    monkeypatch.chdir(project)
    inputs.link(_cfg(str(outside)))
    assert os.readlink(inputs.DATA_LINK) == str(outside.resolve())
    assert (inputs.DATA_LINK / "a" / "1.txt").read_text() == "one"


def test_packaged_data_and_model_link_to_their_installed_folders(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    inputs.link(_cfg())
    assert inputs.DATA_LINK.resolve() == data.bbcnews_dir().resolve()
    assert inputs.MODEL_LINK.resolve() == Path(loader.resolve_model_path("packaged:all-MiniLM-L6-v2")).resolve()
    assert (inputs.MODEL_LINK / "config.json").is_file()


def test_a_model_built_from_config_or_an_uncached_hub_id_is_a_small_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d.csv").write_text("text\na\n")
    inputs.link(_cfg("d.csv", None, "causal-lm"))
    assert not inputs.MODEL_LINK.is_symlink()
    assert json.loads(inputs.MODEL_LINK.read_text())["model.name_or_path"] is None
    import huggingface_hub.constants as hub
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(loader, "resolve_model_path", lambda name: name)  # a hub id (no network here)
    assert inputs.model_target("org/tiny") == {"model.name_or_path": "org/tiny",
                                               "kind": "hub id, not in the local Hugging Face cache when linked"}
    ref = tmp_path / "hub" / "models--org--tiny" / "refs" / "main"
    ref.parent.mkdir(parents=True)
    ref.write_text("0123abcd")  # the commit a download brought: a newer download rewrites it
    assert inputs.model_target("org/tiny") == ref


def test_untracked_model_directory_in_a_queued_experiment_says_dvc_add(tmp_path, monkeypatch):
    clone = tmp_path / ".dvc" / "tmp" / "exps" / "tmpabc"
    clone.mkdir(parents=True)
    (tmp_path / "mymodel").mkdir()
    (tmp_path / "mymodel" / "config.json").write_text("{}")
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))
    monkeypatch.chdir(clone)
    with pytest.raises(ModelError, match=r"model.name_or_path='mymodel' is in your repository .* neither git "
                                         r"nor DVC tracks it.*`dvc add mymodel`, commit"):
        inputs.model_target("mymodel")
    assert not inputs.LINKS.exists()  # a refused input changes no link
