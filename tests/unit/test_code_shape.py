"""The code's shape rules (ARCHITECTURE.md): no function over 60 lines in src/ and bench/, stage
modules thin (load -> call -> write, at most 80 lines). Lines are counted from ``def`` to the
function's last line, docstring included."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MAX_FUNCTION, MAX_STAGE = 60, 80


def _long_functions(root: Path) -> list[str]:
    out = []
    for f in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION:
                    out.append(f"{f.relative_to(REPO)}:{node.lineno} {node.name} ({n} lines)")
    return out


def test_no_function_is_over_60_lines():
    assert _long_functions(REPO / "src") + _long_functions(REPO / "bench") == []


def test_stage_modules_are_thin():
    long = {p.name: len(p.read_text().splitlines()) for p in (REPO / "src/onegpu/stages").glob("*.py")}
    assert {name: n for name, n in long.items() if n > MAX_STAGE} == {}


def _private_imports(root: Path) -> list[str]:
    """``from onegpu.<module> import _name``: a module's private name used by another module."""
    out = []
    for f in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("onegpu"):
                out += [f"{f.relative_to(REPO)}:{node.lineno} {a.name}" for a in node.names
                        if a.name.startswith("_")]
    return out


def test_no_module_imports_another_modules_private_names():
    assert _private_imports(REPO / "src") == []


# The top level holds entry points and foundations only (ARCHITECTURE.md); a feature's modules go in its package.
TOP_LEVEL = {"cli", "config", "errors", "evaluation", "formatting", "inputs", "interpreter", "net", "paths",
             "summary", "ui"}


def test_the_top_level_holds_at_most_11_modules_and_these():
    top = {p.stem for p in (REPO / "src/onegpu").glob("*.py")} - {"__init__", "__main__"}
    assert top == TOP_LEVEL and len(top) <= 11
