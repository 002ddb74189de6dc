"""dvc.yaml lists, for each stage, every file the stage reads: its code (the stage module and every onegpu
module it imports, also lazily or by name) and, through the inputs stage, the data and model that
params.yaml names."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "src"
STAGES = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]


def _file(module: str) -> Path:
    p = SRC / Path(*module.split("."))
    return p / "__init__.py" if p.is_dir() else p.with_suffix(".py")


def _imports(path: Path) -> set[str]:
    """onegpu modules that ``path`` imports anywhere (top level or inside functions), or names in a
    string (``importlib.import_module("onegpu.training.backends.accelerate")``)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("onegpu.")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("onegpu"):
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                out.add(sub if _file(sub).is_file() else node.module)
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
              and re.fullmatch(r"onegpu(\.\w+)+", node.value) and _file(node.value).is_file()):
            out.add(node.value)
    return out


def code_read_by(stage: str) -> set[str]:
    """Repo-relative paths of the onegpu source files ``onegpu <stage>`` can import."""
    seen, todo = set(), [f"onegpu.stages.{stage}"]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo += _imports(_file(m))
    return {_file(m).relative_to(REPO).as_posix() for m in seen if _file(m).name != "__init__.py"}


@pytest.mark.parametrize("stage", ["inputs", "prepare", "train", "evaluate"])
def test_code_deps_match_what_the_stage_imports(stage):
    deps = [d for d in STAGES[stage]["deps"] if d.startswith("src/")]
    code = code_read_by(stage)
    covered = {f for f in code if any(f == d or f.startswith(d.rstrip("/") + "/") for d in deps)}
    assert code - covered == set(), f"{stage} imports these but dvc.yaml does not list them"
    stray = [d for d in deps if not any(f == d or f.startswith(d.rstrip("/") + "/") for f in code)]
    assert stray == [], f"{stage} lists these but never imports them"


def test_stages_that_read_params_named_inputs_depend_on_their_links():
    """No stage is always changed (`dvc status` would never say up to date); the inputs stage's links are
    persistent, uncached outs (DVC neither deletes nor caches what they point to), one per param."""
    from onegpu import inputs
    assert not any(s.get("always_changed") for s in STAGES.values())
    links = {str(inputs.DATA_LINK), str(inputs.MODEL_LINK)}
    assert STAGES["inputs"]["outs"] == [{link: {"cache": False, "persist": True}} for link in sorted(links)]
    assert set(STAGES["inputs"]["params"]) == {"data.source", "model.name_or_path"}
    # prepare reads the data and the model's tokenizer; train reads the model's weights.
    assert links <= set(STAGES["prepare"]["deps"])
    assert str(inputs.MODEL_LINK) in STAGES["train"]["deps"]
    assert "/inputs/" in (REPO / "data" / ".gitignore").read_text().splitlines()  # machine-specific links
    assert {"data/processed", "models"} <= set(STAGES["evaluate"]["deps"])


def test_step_plots_show_loss_memory_and_speed_with_a_dash_pattern_per_experiment():
    """Issue 20 item 8: `dvc plots diff` of equal runs drew one line for three legend entries (equal
    values lie on one another; DVC's linear template tells revisions apart by colour only) and had no
    memory or speed plot. Each step plot is a column train writes, drawn with .dvc/plots/steps.json,
    whose dash pattern, like the colour, follows the revision."""
    import json

    from onegpu.stages.train import STEP_COLUMNS
    plots = yaml.safe_load((REPO / "dvc.yaml").read_text())["plots"]
    steps = {name: p for d in plots for name, p in d.items() if "plots/train_steps.csv" in (p.get("y") or {})}
    assert sorted(p["y"]["plots/train_steps.csv"] for p in steps.values()) == ["loss", "mem_peak_mib",
                                                                              "samples_per_second"]
    assert all(p["template"] == "steps" and p["y"]["plots/train_steps.csv"] in STEP_COLUMNS for p in steps.values())
    template = json.loads((REPO / ".dvc/plots/steps.json").read_text())
    dash = template["encoding"]["strokeDash"]
    assert dash["field"] == "rev" and len({str(r) for r in dash["scale"]["range"]}) >= 4
    assert template["encoding"]["color"] == "<DVC_METRIC_COLOR>"  # DVC fills the colour per revision
