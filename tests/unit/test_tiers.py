"""Every proof keeps a tier: docs/proofs.md lists each proof file with the command that runs it, and this file
checks the list against what pytest itself collects and the Makefile's selection.

The tiers (Makefile): ``make test`` selects the tests whose markers satisfy ``TIER_TEST`` (``not slow``);
``make test-all`` (CI's) selects every test. A ``gpu`` test runs where torch sees a CUDA device (the GPU check,
bench/gpu_check.sh) and is skipped elsewhere. A file's tier is ``make test`` when ``make test`` selects every
one of its tests, ``make test-all`` when it selects none, ``both`` otherwise (a file's proofs on a packaged
model or at full width are ``slow``, their twins are not).

A proof file is a test file under ``tests/unit/equivalence``, ``tests/integration`` or ``tests/gpu``, one with a
``slow`` test, or one that README.md or a page of docs/ names. The markers are read from one ``pytest
--collect-only`` of the whole suite (tests/collect_marks.py): file, class, function and parameter marks alike.
"""
from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROOFS_PAGE = REPO / "docs" / "proofs.md"
TIERS = ("make test", "make test-all", "both", "GPU check")


def tier_expression() -> str:
    """The Makefile's ``TIER_TEST``: the marker expression of ``make test``."""
    found = re.search(r"^TIER_TEST\s*:?=\s*(.+)$", (REPO / "Makefile").read_text(), re.M)
    assert found, "the Makefile defines no TIER_TEST"
    return found.group(1).strip()


def selected(expression: str, marks) -> bool:
    """Whether pytest's ``-m expression`` selects a test with ``marks`` (and, or, not, parentheses, names)."""
    assert re.fullmatch(r"[\w\s()]+", expression), expression
    return bool(eval(expression, {"__builtins__": {}}, defaultdict(bool, dict.fromkeys(marks, True))))


@functools.cache
def collected() -> dict[str, dict[str, list[str]]]:
    """Each collected test file (relative to tests/) -> its tests' node ids -> their markers' names."""
    out = REPO / ".pytest-collect-marks.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    try:
        p = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "tests.collect_marks",
                            "-p", "no:cacheprovider", "tests"], cwd=REPO, capture_output=True, text=True,
                           env={**env, "ONEGPU_COLLECT_MARKS": str(out)}, timeout=300)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        marks = json.loads(out.read_text())
    finally:
        out.unlink(missing_ok=True)
    files: dict[str, dict[str, list[str]]] = defaultdict(dict)
    for nodeid, names in marks.items():
        files[nodeid.split("::")[0].removeprefix("tests/")][nodeid] = names
    return dict(files)


def tier(tests: dict[str, list[str]], expression: str) -> str:
    """The tier (one of ``TIERS``) of a file whose tests have these markers."""
    if tests and all("gpu" in m for m in tests.values()):
        return "GPU check"
    picked = [selected(expression, m) for m in tests.values()]
    return "make test" if all(picked) else "make test-all" if not any(picked) else "both"


def named_in_docs() -> set[str]:
    """Test files (relative to tests/) that README.md or docs/*.md name."""
    text = "\n".join(p.read_text() for p in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))])
    return {m for m in re.findall(r"(?:tests/)?((?:unit|integration|gpu)/[\w/]+\.py)", text)}


def proof_files(files: dict[str, dict[str, list[str]]]) -> set[str]:
    """The proof files (see the module's docstring) among the collected ``files``, relative to tests/."""
    picked = {f for f, tests in files.items() if f.startswith(("unit/equivalence/", "integration/", "gpu/"))
              or any("slow" in m for m in tests.values())}
    return picked | (named_in_docs() & set(files))


def listed() -> dict[str, str]:
    """docs/proofs.md's table rows: test file (relative to tests/) -> the tier it states."""
    rows = re.findall(r"^\|[^|\n]*\|\s*`tests/([\w/]+\.py)`\s*\|\s*([^|\n]+?)\s*\|", PROOFS_PAGE.read_text(), re.M)
    table: dict[str, str] = {}
    for path, stated in rows:
        assert table.get(path, stated) == stated, f"docs/proofs.md gives tests/{path} two tiers"
        table[path] = stated
    return table


def test_every_proof_file_is_listed_with_the_tier_its_markers_give():
    expression, files, table = tier_expression(), collected(), listed()
    missing = sorted(proof_files(files) - set(table))
    assert not missing, f"proof files that docs/proofs.md does not list: {missing}"
    for path, stated in table.items():
        assert path in files, f"docs/proofs.md lists tests/{path}, which holds no collected test"
        assert stated in TIERS, f"docs/proofs.md: tests/{path}: {stated!r} is none of {TIERS}"
        assert stated == tier(files[path], expression), (
            f"docs/proofs.md says tests/{path} runs in {stated!r}; its markers put it in "
            f"{tier(files[path], expression)!r}")


def test_the_tier_of_a_file_follows_its_tests_markers():
    """Slow tests only, both kinds, GPU tests only, and a marker expression of more than one name."""
    assert tier({"a": ["slow"], "b": ["slow", "big_memory"]}, "not slow") == "make test-all"
    assert tier({"a": ["slow"], "b": ["parametrize"]}, "not slow") == "both"
    assert tier({"a": ["slow"], "b": []}, "slow or not slow") == "make test"
    assert tier({"a": ["gpu"], "b": ["gpu", "slow"]}, "not slow") == "GPU check"
    assert tier({"a": ["big_memory"]}, "not slow and not big_memory") == "make test-all"
