"""``onegpu inputs``: fingerprint what ``data.source`` and ``model.name_or_path`` name -> data/inputs.json.

DVC runs this stage on every ``dvc repro``/``dvc exp run`` (``always_changed``); prepare and train depend
on its output, so they re-run exactly when the data or the model changed (see :mod:`onegpu.inputs`).
The file is written only when its content changes, and atomically.
"""
from __future__ import annotations

from onegpu import data, inputs, measure, paths
from onegpu.config import Config


def run(cfg: Config) -> dict:
    watch = measure.Stopwatch()
    data.check_input(cfg)  # the data's columns and form, before anything is hashed or written
    found = inputs.describe(cfg)
    old = paths.read_json(paths.INPUTS) if paths.INPUTS.is_file() else None
    if found != old:
        paths.write_json_atomic(paths.INPUTS, found)
    d, m = found["data"], found["model"]
    model = m["kind"] if m["name_or_path"] is None else f"{m['name_or_path']} ({m['kind']}" + (
        f", {m['files']} files, sha256 {m['sha256'][:12]})" if "sha256" in m else f", revision {m['revision']})")
    print(f"inputs: data {d['source']} ({d['kind']}, {d['files']} files, sha256 {d['sha256'][:12]}), "
          f"model {model}, {'changed' if found != old else 'unchanged'}, {watch.total():.1f} s -> {paths.INPUTS}")
    return found
