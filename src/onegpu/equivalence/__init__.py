"""The equivalence key: which params define the mathematics of a training run (:mod:`.key`).

The train stage computes it (the run's ``equivalence_key`` tag, the ``resolved.*`` params, the hash that
guards resumes); ``onegpu compare`` (:mod:`onegpu.compare`) and ``onegpu tradeoffs`` read it back.
``from onegpu.equivalence import ...`` gives its public names."""
from onegpu.equivalence.key import (
                                    KEY_TAG,
                                    MODEL_FROM_CONFIG_KEYS,
                                    NOT_IN_EQUIVALENCE_KEY,
                                    RESOLVED_ACCUMULATION,
                                    RESOLVED_EFFECTIVE_BATCH,
                                    RESOLVED_MICRO_BATCH,
                                    RESOLVED_WORLD_SIZE,
                                    equivalence_fields,
                                    equivalence_key,
                                    resolved_params,
                                    run_config_hash,
)

__all__ = [
    "KEY_TAG", "MODEL_FROM_CONFIG_KEYS", "NOT_IN_EQUIVALENCE_KEY", "RESOLVED_ACCUMULATION",
    "RESOLVED_EFFECTIVE_BATCH", "RESOLVED_MICRO_BATCH", "RESOLVED_WORLD_SIZE", "equivalence_fields",
    "equivalence_key", "resolved_params", "run_config_hash",
]
