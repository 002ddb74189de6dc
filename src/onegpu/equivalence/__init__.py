"""Equivalence of training runs: the key that groups them (:mod:`.key`) and the step-by-step comparison
within a group (:mod:`.comparison`). ``from onegpu.equivalence import ...`` gives the public names of both."""
from onegpu.equivalence.comparison import (DIVERGED, EPS, EQUIVALENT, EVAL_METRICS, GRAD_NORM_TOLERANCES,
                                           INCOMPLETE, NO_DATA, REFERENCE, TOLERANCE_BASIS, TOLERANCES,
                                           Comparison, Diff, GroupComparison, RunComparison, RunRecord, Series,
                                           Tolerance, choose_reference, compare, compare_group, compare_run,
                                           find_overlaps, first_divergence, grad_norm_tolerance_for,
                                           group_by_key, likely_causes, series_diff, summarize, tolerance_for)
from onegpu.equivalence.key import (KEY_TAG, MODEL_FROM_CONFIG_KEYS, NOT_IN_EQUIVALENCE_KEY, RESOLVED_ACCUMULATION,
                                    RESOLVED_EFFECTIVE_BATCH, RESOLVED_MICRO_BATCH, RESOLVED_WORLD_SIZE,
                                    equivalence_fields, equivalence_key, resolved_params, run_config_hash)

__all__ = [
    "DIVERGED", "EPS", "EQUIVALENT", "EVAL_METRICS", "GRAD_NORM_TOLERANCES", "INCOMPLETE", "NO_DATA", "REFERENCE",
    "TOLERANCE_BASIS", "TOLERANCES", "Comparison", "Diff", "GroupComparison", "RunComparison", "RunRecord",
    "Series", "Tolerance", "choose_reference", "compare", "compare_group", "compare_run", "find_overlaps",
    "first_divergence", "grad_norm_tolerance_for", "group_by_key", "likely_causes", "series_diff", "summarize",
    "tolerance_for",
    "KEY_TAG", "MODEL_FROM_CONFIG_KEYS", "NOT_IN_EQUIVALENCE_KEY", "RESOLVED_ACCUMULATION",
    "RESOLVED_EFFECTIVE_BATCH", "RESOLVED_MICRO_BATCH", "RESOLVED_WORLD_SIZE", "equivalence_fields",
    "equivalence_key", "resolved_params", "run_config_hash",
]
