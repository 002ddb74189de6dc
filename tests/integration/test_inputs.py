"""What params.yaml names (data.source, model.name_or_path) is a dependency DVC sees (data/inputs/*
link to it): editing the CSV, JSONL, text directory or model directory makes `dvc status` name prepare or
train (the CSV's `dvc repro` then reads the edited rows; a model directory trains under `dvc exp run`);
unchanged inputs re-run nothing and `dvc status` says up to date. A queued/--temp experiment on an untracked file
says to add it."""
from __future__ import annotations

import csv
import json
import os
import shutil
from pathlib import Path

import pytest

from .conftest import dvc, make_project, run

pytestmark = pytest.mark.slow


def _rows(labels: str, per_label: int = 30, tag: str = "") -> list[tuple[str, str]]:
    return [(f"{tag}example {i} of class {lab}, written for the test", lab)
            for lab in labels for i in range(per_label)]


def _write_csv(path: Path, rows) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["text", "label"])
        w.writerows(rows)


def _write_jsonl(path: Path, rows) -> None:
    path.write_text("".join(json.dumps({"text": t, "label": lab}) + "\n" for t, lab in rows))


def _write_tree(root: Path, rows) -> None:
    shutil.rmtree(root, ignore_errors=True)
    for i, (t, lab) in enumerate(rows):
        (root / lab).mkdir(parents=True, exist_ok=True)
        (root / lab / f"{i:03d}.txt").write_text(t)


def _commit(p: Path, message: str) -> None:
    run(["git", "add", "-A"], p)
    run(["git", "commit", "-qm", message], p)


def _ran(out: str) -> set[str]:
    return {s for s in ("inputs", "prepare", "train", "evaluate") if f"Running stage '{s}'" in out}


def _status(p: Path, *targets: str) -> str:
    return dvc(p, "status", *targets).stdout


def _names(status: str) -> set[str]:
    """The stages `dvc status` lists as changed."""
    return {line[:-1] for line in status.splitlines() if line.endswith(":") and not line.startswith("\t")}


def _edited(link: str) -> str:
    """The line `dvc status` prints for an input whose linked file or folder changed."""
    return f"modified:           data/inputs/{link}"


def _labels(p: Path) -> list[str]:
    return json.loads((p / "data" / "stats.json").read_text())["labels"]


def test_csv_edit_is_named_by_dvc_status_and_reruns_prepare_and_train(tmp_path):
    p = make_project(tmp_path, {"data": {"source": "d.csv"}})
    _write_csv(p / "d.csv", _rows("ab"))
    _commit(p, "data")
    # Up to train (evaluate's own up-to-date check after a repro: test_shared_experiments.py).
    assert _ran(dvc(p, "repro", "train").stdout) == {"inputs", "prepare", "train"}
    assert _labels(p) == ["a", "b"]
    assert os.readlink(p / "data" / "inputs" / "data.source") == "../../d.csv"
    _commit(p, "repro")

    assert "Data and pipelines are up to date" in _status(p, "--with-deps", "train")  # nothing "always changed"
    assert "Data and pipelines are up to date" in _status(p, "prepare")
    same = dvc(p, "repro", "train").stdout
    assert _ran(same) == set(), same

    _write_csv(p / "d.csv", _rows("abc", tag="new "))  # new rows and a third label
    status = _status(p, "prepare")
    assert {"prepare"} <= _names(status) and _edited("data.source") in status, status
    assert _names(_status(p, "--with-deps", "train")) == {"inputs", "prepare"}  # train: once prepare re-ran
    out = dvc(p, "repro", "prepare").stdout
    assert _ran(out) == {"inputs", "prepare"}, out
    assert _labels(p) == ["a", "b", "c"]
    # the new prepared data makes reference (a note here) and train stale; the first repro showed they run then
    assert _names(_status(p, "--with-deps", "train")) == {"reference", "train"}
    assert "Data and pipelines are up to date" in _status(p, "prepare")


@pytest.mark.parametrize("kind", ["jsonl", "directory"])
def test_jsonl_and_directory_edits_are_named_by_dvc_status(tmp_path, kind):
    """What DVC hashes differs by kind (a file, a folder through the link); what `dvc repro` does with a
    stage `dvc status` names is DVC's, and the CSV test above checks that it reads the edited rows."""
    source, write = {"jsonl": ("d.jsonl", _write_jsonl), "directory": ("texts", _write_tree)}[kind]
    p = make_project(tmp_path, {"data": {"source": source}})
    write(p / source, _rows("ab"))
    _commit(p, "data")
    assert _ran(dvc(p, "repro", "prepare").stdout) == {"inputs", "prepare"}
    assert _labels(p) == ["a", "b"]
    _commit(p, "repro")

    assert "Data and pipelines are up to date" in _status(p, "prepare")
    same = dvc(p, "repro", "prepare").stdout
    assert _ran(same) == set() and "Stage 'prepare' didn't change, skipping" in same

    write(p / source, _rows("abc", tag="new "))
    status = _status(p, "prepare")
    assert "prepare" in _names(status) and _edited("data.source") in status, status


def test_packaged_default_is_up_to_date_until_the_params_change(tmp_path, prepared):
    """bbcnews and the packaged MiniLM: the links point at the installed packages' folders, `dvc status`
    is up to date after a repro, and `dvc exp run -S data.source=<file>` relinks and re-runs prepare.
    (The repro is ``prepared``'s: its output is checked here, in a copy of its project.)"""
    from onegpu import data
    from onegpu.models import loader
    assert _ran(prepared.output()) == {"inputs", "prepare"}
    p = prepared(tmp_path)
    links = p / "data" / "inputs"
    assert (links / "data.source").resolve() == data.bbcnews_dir().resolve()
    assert (links / "model.name_or_path").resolve() == Path(loader.resolve_model_path(
        "packaged:all-MiniLM-L6-v2")).resolve()
    _write_csv(p / "d.csv", _rows("ab"))
    _commit(p, "data")
    assert "Data and pipelines are up to date" in _status(p, "prepare")
    out = dvc(p, "exp", "run", "prepare", "-S", "data.source=d.csv").stdout
    assert _ran(out) == {"inputs", "prepare"}, out
    assert _labels(p) == ["a", "b"]
    assert os.readlink(links / "data.source") == "../../d.csv"


def test_model_directory_under_dvc_exp_run_trains_and_an_edit_is_named_by_dvc_status(tmp_path):
    """A local copy of the packaged MiniLM as model.name_or_path (kept out of git, as a user's model
    folder often is: the workspace `dvc exp run` reads it in place). What `dvc exp run` does with a stage
    `dvc status` names is DVC's; the CSV test above re-runs one."""
    from onegpu.models import loader
    p = make_project(tmp_path, {"model": {"name_or_path": "./mini"}})
    shutil.copytree(loader.resolve_model_path("packaged:all-MiniLM-L6-v2"), p / "mini")
    with open(p / ".gitignore", "a") as f:
        f.write("/mini/\n")
    _commit(p, "model dir")
    first = dvc(p, "exp", "run", "train").stdout
    assert _ran(first) == {"inputs", "prepare", "train"}, first

    same = dvc(p, "exp", "run", "train").stdout
    assert _ran(same) == set(), same
    assert "Stage 'train' didn't change, skipping" in same
    assert "Data and pipelines are up to date" in _status(p, "train")

    config = json.loads((p / "mini" / "config.json").read_text())
    config["attention_probs_dropout_prob"] = 0.2  # overridden by TINY's model.dropout: 0, still an edit
    (p / "mini" / "config.json").write_text(json.dumps(config, indent=2))
    status = _status(p, "train")
    assert "train" in _names(status) and _edited("model.name_or_path") in status, status


def test_temp_experiment_on_an_untracked_csv_says_to_add_it(tmp_path):
    p = make_project(tmp_path)
    _write_csv(p / "d.csv", _rows("ab"))  # in the workspace, never added to git or DVC
    proc = dvc(p, "exp", "run", "--temp", "-S", "data.source=d.csv", check=False)
    assert proc.returncode != 0
    both = proc.stdout + proc.stderr
    assert "Traceback" not in both
    [line] = [x for x in both.splitlines() if x.startswith("onegpu inputs: error:")]
    assert line == (f"onegpu inputs: error: data.source='d.csv' is in your repository ({p.resolve() / 'd.csv'}) "
                    "but neither git nor DVC tracks it, and DVC runs queued and --temp experiments in a clean "
                    "clone that holds only tracked files: `git add d.csv` (small files) or `dvc add d.csv`, "
                    "commit, and queue the experiment again")
