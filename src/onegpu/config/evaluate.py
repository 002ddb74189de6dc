"""The ``evaluate`` section (:class:`EvaluateConfig`)."""
from __future__ import annotations

from dataclasses import dataclass

from onegpu.config.knobs import EVALUATION, POSITIVE_INT, OutOfKey, knob


@dataclass
class EvaluateConfig:
    per_device_eval_batch_size: int = knob(64, key=EVALUATION, help="examples per evaluation batch",
                                           rule=POSITIVE_INT)
    max_new_tokens: int = knob(32, help=(
        "instruction data: tokens generated (greedy) per test prompt, scored by ROUGE-L"),
                               rule=(lambda v: 1 <= v <= 4096, "must be an integer from 1 to 4096 (tokens), got {v}"),
                               key=OutOfKey("evaluation only (generation length)"))
