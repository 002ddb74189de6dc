"""``onegpu inputs``: link what ``data.source`` and ``model.name_or_path`` name as
``data/inputs/data.source`` and ``data/inputs/model.name_or_path``, the paths prepare and train depend on.

DVC runs this stage when those params change or a link is missing (a fresh clone, DVC's clone of a queued
experiment); DVC itself hashes what the links point to, so ``dvc status`` names prepare or train when the
data or the model changed (see :mod:`onegpu.inputs`). Each link is replaced atomically.
"""
from __future__ import annotations

from onegpu import inputs
from onegpu.config import Config
from onegpu.data import check
from onegpu.measure import memory


def run(cfg: Config) -> dict[str, str]:
    watch = memory.Stopwatch()
    check.check_input(cfg)  # the data's columns and form, before anything is linked or written
    found = inputs.link(cfg)
    print(f"inputs: data.source {cfg.data.source} -> {found['data.source']}, model.name_or_path "
          f"{cfg.model.name_or_path} -> {found['model.name_or_path']} ({watch.total():.2f} s; "
          f"{inputs.LINKS}/ holds the links DVC hashes)")
    return found
