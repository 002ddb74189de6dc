"""The onegpu modules a source file imports, read from its text (no import runs): what test_dvc_yaml.py
(a stage's code deps) and test_code_shape.py (no circle, training's rooms downwards) both follow."""
from __future__ import annotations

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"


def module_file(module: str, src: Path = SRC) -> Path:
    """The file of dotted ``module`` under ``src`` (a package: its ``__init__.py``)."""
    p = src / Path(*module.split("."))
    return p / "__init__.py" if p.is_dir() else p.with_suffix(".py")


def imports(path: Path, src: Path = SRC, by_name: bool = True) -> set[str]:
    """onegpu modules that ``path`` imports anywhere (top level, inside functions, under ``TYPE_CHECKING``):
    ``from P import m`` is module ``P.m`` when that is a module, else ``P``; with ``by_name``, also modules
    named in a string (``importlib.import_module("onegpu.training.backends.accelerate")``)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("onegpu.")}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("onegpu"):
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                out.add(sub if module_file(sub, src).is_file() else node.module)
        elif (by_name and isinstance(node, ast.Constant) and isinstance(node.value, str)
              and re.fullmatch(r"onegpu(\.\w+)+", node.value) and module_file(node.value, src).is_file()):
            out.add(node.value)
    return out


def graph(src: Path = SRC) -> dict[str, set[str]]:
    """Every module under ``src``/onegpu (dotted; a package by its ``__init__``) -> the onegpu modules its
    import statements import (:func:`imports` without names in strings), itself left out."""
    files = {".".join(f.relative_to(src).with_suffix("").parts).removesuffix(".__init__"): f
             for f in (src / "onegpu").rglob("*.py")}
    return {name: imports(f, src, by_name=False) - {name} for name, f in files.items()}
