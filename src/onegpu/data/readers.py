"""The one registry of data readers, keyed by the format :func:`onegpu.data.check.check_input` returns.

A new format: a module with a :class:`onegpu.data.base.Reader` subclass, its name in
:data:`onegpu.data.formats.COLUMNS` and ``DROP_REASONS``, its detection in :mod:`onegpu.data.formats`, and
one line here; prepare and the estimate's sample take it from :data:`READERS`.
"""
from __future__ import annotations

from onegpu.data import formats, messages, preference, prompt_answer, prompt_completion, text
from onegpu.data.base import Reader

READERS: dict[str, Reader] = {formats.TEXT: text.READER, formats.PROMPT_COMPLETION: prompt_completion.READER,
                              formats.MESSAGES: messages.READER, formats.PREFERENCE: preference.READER,
                              formats.PROMPT_ANSWER: prompt_answer.READER}


def reader(fmt: str) -> Reader:
    """The reader of format ``fmt``. Raises KeyError for a format no reader reads (a bug, not bad data)."""
    return READERS[fmt]
