"""One training. Its rooms, each importing only the ones listed after it: the orchestration at this level
(:mod:`.tracked_run`, :mod:`.session`, :mod:`.backends`, :mod:`.validation`, :mod:`.around_steps`,
:mod:`.prepared`), then :mod:`.record`, :mod:`.memory`, :mod:`.objectives` (each ``model.task``'s rows,
batches, exact loss and held-out figures), :mod:`.lifecycle` and :mod:`.parallel`."""
