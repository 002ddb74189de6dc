"""tests/unit mirrors src/onegpu: ``src/onegpu/<package>/<module>.py`` is tested in
``tests/unit/<package>/test_<module>.py`` (a top-level module in ``tests/unit/test_<module>.py``). A module
without a test module at its mirror path is listed in ``EXEMPT`` with where it is tested instead."""
from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "src" / "onegpu"
UNIT = REPO / "tests" / "unit"

_STAGE = "a thin stage entry point, run by the integration tests"
_SECTION = ("a params section's declarations and combinations: tests/unit/config/test_checks.py (each rule and "
            "combination through from_container), test_schema.py (declared once, in params.yaml)")
EXEMPT = {
    # Package markers (``__init__.py``, any depth) are exempt by rule: they re-export their modules' names.
    "__main__.py": "`python -m onegpu`: calls cli.entry; tests/unit/test_cli.py and the integration tests",
    "config/data.py": _SECTION,
    "config/evaluate.py": _SECTION,
    "config/model.py": _SECTION,
    "config/tracking.py": _SECTION,
    "compare/records.py": "RunRecord: tests/unit/compare/test_verdict.py, test_groups.py (built by records.py)",
    "compare/summary.py": "one group in sentences: tests/unit/compare/test_groups.py, test_report.py",
    "models/packaged.py": "the GGUF conversion: tests/unit/training/objectives/test_batches.py, "
                          "tests/integration/test_sft.py",
    "stages/evaluate.py": _STAGE + " (test_pipeline.py)",
    "stages/inputs.py": _STAGE + " (test_inputs.py)",
    "stages/prepare.py": _STAGE + " (test_pipeline.py)",
    "stages/tradeoffs.py": _STAGE + " (test_tradeoffs.py); its arguments in tests/unit/test_cli.py",
    "tracking/runs.py": "RunHandle: tests/unit/tracking/test_store.py, test_spool.py write through it",
    "tracking/uri.py": "the store URI: tests/unit/tracking/test_store.py, tests/unit/test_paths.py",
    "training/objectives/heldout.py": "the exact held-out figures: tests/unit/test_evaluation.py (through "
                                      "evaluation's names), tests/unit/training/test_validation.py",
    "training/objectives/base.py": "the interface: tests/unit/training/objectives/ (each objective, the registry)",
    "training/backends/accelerate.py": "tests/unit/training/backends/test_base.py: both backends step for step",
}


def mirror(module: Path) -> Path:
    """The test module's path for ``module`` (relative to src/onegpu)."""
    return UNIT / module.parent / f"test_{module.name}"


def untested() -> list[str]:
    """Modules of src/onegpu, package markers left out, without a test module at their mirror path."""
    modules = (p.relative_to(SRC) for p in SRC.rglob("*.py") if p.name != "__init__.py")
    return sorted(m.as_posix() for m in modules if not mirror(m).exists())


def test_every_module_has_a_test_module_at_its_mirror_path_or_says_where_it_is_tested():
    assert untested() == sorted(EXEMPT)
