"""onegpu.errors: an error in one line, and the note a run's page shows when its stage failed or was stopped."""
from __future__ import annotations

from onegpu import errors


def test_an_error_in_one_line_is_its_type_and_the_first_line_of_its_message_cut_at_the_limit():
    assert errors.one_line(RuntimeError("CUDA error\nstack")) == "RuntimeError: CUDA error"
    assert errors.one_line(ValueError("x" * 500), 10) == "ValueError: " + "x" * 10
    assert errors.one_line(KeyError()) == "KeyError"


def test_a_stage_note_says_failed_or_stopped_and_what_to_do():
    then = "`dvc repro` runs it again."
    assert errors.failure_note(OSError("disk gone\nmore"), "Prepare", then) == (
        "**Prepare failed**: `OSError: disk gone` (FAILED; tag `error.message`). `dvc repro` runs it again.")
    assert errors.failure_note(KeyboardInterrupt("SIGTERM stopped the run"), "Prepare", then) == (
        "**Prepare stopped** (SIGTERM stopped the run; KILLED). `dvc repro` runs it again.")


def test_prepares_note_says_nothing_was_kept():
    from onegpu.stages import prepare
    assert prepare._failure_note(ValueError("bad")).endswith("Nothing half-written was kept; once the cause is fixed, "
                                                             "`dvc repro` runs it again.")
