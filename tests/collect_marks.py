"""A pytest plugin that writes, at the end of collection, every collected test's node id and the names of its
markers (file, class, function and parameter marks alike) as JSON to the file ``ONEGPU_COLLECT_MARKS`` names.
tests/unit/test_tiers.py runs ``pytest --collect-only -p tests.collect_marks`` to read each proof's tier."""
from __future__ import annotations

import json
import os


def pytest_collection_finish(session):
    marks = {item.nodeid: sorted({m.name for m in item.iter_markers()}) for item in session.items}
    with open(os.environ["ONEGPU_COLLECT_MARKS"], "w") as f:
        json.dump(marks, f)
