"""``onegpu compare``: are runs with the same ``equivalence_key`` the same training, step for step, and
what does each cost?

Pure logic on plain records (:mod:`onegpu.tracking` fetches the runs; nothing here touches MLflow or
torch), one module per concern:

* :mod:`.records`: a training run as MLflow logged it (:class:`RunRecord`, parsing its string params);
* :mod:`.tolerances`: machine epsilon and the per-step tolerances of each precision, with their basis;
* :mod:`.verdict`: one run against its reference (per-step differences, the verdict);
* :mod:`.causes`: the likely causes of a divergence, one small function per cause (:data:`CAUSES`);
* :mod:`.groups`: the runs of one key together, the reference, overlaps in time;
* :mod:`.summary`: a group in a few sentences;
* :mod:`.report`, :mod:`.plots`: ``compare.md``, the two PNG plots, the terminal table.

``from onegpu import compare`` gives the names below.
"""
from onegpu.compare.causes import CAUSES, DROPOUT_KERNEL_KNOBS, KERNEL_KNOBS, SFT_KNOBS, likely_causes
from onegpu.compare.groups import (
                                   Comparison,
                                   GroupComparison,
                                   choose_reference,
                                   compare,
                                   compare_group,
                                   find_overlaps,
                                   group_by_key,
)
from onegpu.compare.records import RunRecord, Series, finished_training
from onegpu.compare.summary import summarize
from onegpu.compare.tolerances import (
                                   EPS,
                                   GRAD_NORM_TOLERANCES,
                                   TOLERANCE_BASIS,
                                   TOLERANCES,
                                   Tolerance,
                                   grad_norm_tolerance_for,
                                   tolerance_for,
)
from onegpu.compare.verdict import (
                                   DIVERGED,
                                   EQUIVALENT,
                                   EVAL_METRICS,
                                   INCOMPLETE,
                                   NO_DATA,
                                   REFERENCE,
                                   Diff,
                                   RunComparison,
                                   compare_run,
                                   first_divergence,
                                   series_diff,
)

__all__ = [
    "CAUSES", "DROPOUT_KERNEL_KNOBS", "KERNEL_KNOBS", "SFT_KNOBS", "likely_causes",
    "Comparison", "GroupComparison", "choose_reference", "compare", "compare_group", "find_overlaps",
    "group_by_key", "RunRecord", "Series", "finished_training", "summarize",
    "EPS", "GRAD_NORM_TOLERANCES", "TOLERANCE_BASIS", "TOLERANCES", "Tolerance", "grad_norm_tolerance_for",
    "tolerance_for", "DIVERGED", "EQUIVALENT", "EVAL_METRICS", "INCOMPLETE", "NO_DATA", "REFERENCE", "Diff",
    "RunComparison", "compare_run", "first_divergence", "series_diff",
]
