"""The code's shape rules (ARCHITECTURE.md): no function over 60 lines in src/ and bench/, stage
modules thin (load -> call -> write, at most 80 lines). Lines are counted from ``def`` to the
function's last line, docstring included."""
from __future__ import annotations

import ast
from pathlib import Path

from tests.unit import import_graph

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
TOP_LEVEL = {"cli", "errors", "evaluation", "formatting", "inputs", "interpreter", "net", "paths", "summary", "ui"}


def test_the_top_level_holds_at_most_11_modules_and_these():
    top = {p.stem for p in (REPO / "src/onegpu").glob("*.py")} - {"__init__", "__main__"}
    assert top == TOP_LEVEL and len(top) <= 11


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (networkx's), each sorted."""
    import networkx as nx
    g = nx.DiGraph([(a, b) for a, targets in graph.items() for b in targets])
    return sorted(sorted(c) for c in nx.strongly_connected_components(g) if len(c) > 1)


def test_no_modules_import_each_other_in_a_circle():
    """No set of modules imports itself round, counting lazy and ``TYPE_CHECKING`` imports (ARCHITECTURE.md's
    dependency rule): a circle is one concern split over files, or a helper asking the layer above it."""
    assert _circles(import_graph.graph()) == []
    # what the rule catches: a collator's helper asking the registry that imports it (the shape before rooms)
    planted = {"o.objectives": {"o.objectives.causal_lm"}, "o.objectives.causal_lm": {"o.batches"},
               "o.batches": {"o.objectives"}, "o.loss": {"o.batches"}}
    assert _circles(planted) == [["o.batches", "o.objectives", "o.objectives.causal_lm"]]


# training/'s rooms, top first (ARCHITECTURE.md): a module imports its own room's or a room below it.
TRAINING_ROOMS = ("", "record", "memory", "objectives", "lifecycle", "parallel")


def _room(module: str) -> int | None:
    """The index in :data:`TRAINING_ROOMS` of ``module``'s room (None: not in training/)."""
    parts = module.split(".")
    if parts[:2] != ["onegpu", "training"]:
        return None
    return TRAINING_ROOMS.index(parts[2]) if len(parts) > 3 and parts[2] in TRAINING_ROOMS else 0


def _upward(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets
                  if _room(a) is not None and _room(b) is not None and _room(b) < _room(a))


def test_training_rooms_import_only_their_own_or_the_rooms_below():
    assert _upward(import_graph.graph()) == []
    # what the rule catches: FSDP2's per-rank prediction once took its state formula from the memory room
    planted = {"onegpu.training.parallel.sharding": {"onegpu.training.memory.autobatch", "onegpu.config"}}
    assert _upward(planted) == ["onegpu.training.parallel.sharding -> onegpu.training.memory.autobatch"]
