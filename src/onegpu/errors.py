"""Errors that are the user's to fix: the CLI prints their message alone (no traceback) and exits 2."""


class UserError(Exception):
    """Bad input: params, data or model paths. The message names the problem and what is allowed."""


class ConfigError(UserError):
    """params.yaml has an unknown key, a wrong type or a value out of range."""


class DataError(UserError):
    """The data source is missing, empty or malformed."""


class ModelError(UserError):
    """The model path or id cannot be used for the task."""


class DiskFullError(UserError):
    """No space was left on the device (or the disk quota was reached) while writing a file: the message
    names the path and the free space (:func:`onegpu.paths.writing`)."""


class AlreadySaid(UserError):
    """Bad input whose one line another process of the launch has printed: the CLI exits 2 and prints nothing
    more (the message is for logs and tests)."""


def one_line(error: BaseException, limit: int = 300) -> str:
    """``error`` in one line for a run's description: its type and the first line of its message (at most
    ``limit`` characters), e.g. ``RuntimeError: CUDA error: an illegal memory access``."""
    first = (str(error).strip().splitlines() or [""])[0][:limit]
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


def failure_note(error: BaseException, what: str, then: str) -> str:
    """A run's description (Markdown) when stage ``what`` failed or was stopped: ``**<what> failed**: `<the
    error in one line>` (FAILED; tag `error.message`). <then>``, or ``**<what> stopped** (KILLED). <then>``
    (``then``: what to do now)."""
    if isinstance(error, KeyboardInterrupt):
        return f"**{what} stopped** ({str(error) or 'interrupted'}; KILLED). {then}"
    return f"**{what} failed**: `{one_line(error, 100)}` (FAILED; tag `error.message`). {then}"
