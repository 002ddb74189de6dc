"""One training run as ``onegpu compare`` reads it: :class:`RunRecord`, built from the plain dicts of
:func:`onegpu.tracking.training_runs` (MLflow's params and tags are strings; the properties parse them).
No MLflow here."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from onegpu.equivalence.key import KEY_TAG, RESOLVED_ACCUMULATION, RESOLVED_EFFECTIVE_BATCH, RESOLVED_MICRO_BATCH
from onegpu.errors import UserError
from onegpu.measure import outside_load

Series = list[tuple[int, float]]


def _bool(v) -> bool:
    return str(v).strip().lower() in ("true", "1", "yes")


def as_int(v) -> int | None:
    """An MLflow param or tag (a string) as an int; None when missing or not a number."""
    try:
        return int(float(str(v)))
    except (TypeError, ValueError):
        return None


def as_float(v) -> float | None:
    """An MLflow param or tag (a string) as a finite float; None when missing, not a number or not finite."""
    try:
        x = float(str(v))
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


@dataclass
class RunRecord:
    """One training run as logged to MLflow (params and tags are MLflow's strings).

    Attributes:
        run_id, name: MLflow's run id and run name (the DVC experiment name when there is one).
        params: ``train.*``, ``model.*``, ``resolved.*`` ... as logged.
        tags: ``equivalence_key``, ``device``, ``model.dropout_max``, ``model.batchnorm_layers``,
            ``dvc.exp_name``, ``mlflow.source.git.commit`` ...
        metrics: the last value of each metric (``train_mem_peak_bytes`` in bytes,
            ``train_samples_per_second``, ``eval_*``).
        series: per-step histories, ``{"loss": [(optimizer step, value), ...], ...}``, sorted by step.
        start_time: MLflow's start time, milliseconds since the epoch.
        status: MLflow's run status (SCHEDULED between train and evaluate, RUNNING while a stage writes).
        window: ``(first, last)`` step-metric timestamps in ms, for runs without the window tags.
    """
    run_id: str
    name: str
    params: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    series: dict[str, Series] = field(default_factory=dict)
    start_time: int = 0
    status: str = ""
    window: tuple[int, int] | None = None

    @property
    def train_window(self) -> tuple[int, int] | None:
        """``(first, last)`` milliseconds since the epoch of training's optimizer steps: the tags
        ``onegpu.train_start_ms``/``onegpu.train_end_ms`` the train stage sets, else ``window`` (the
        store's step-metric timestamps, for runs from before those tags); None when unknown."""
        a, b = as_int(self.tags.get("onegpu.train_start_ms")), as_int(self.tags.get("onegpu.train_end_ms"))
        if a is not None and b is not None:
            return a, b
        return tuple(self.window) if self.window else None

    @property
    def outside_load(self) -> dict | None:
        """What other processes took of the machine while it trained (the ``onegpu.outside_load`` tag,
        :mod:`onegpu.measure.outside_load`); None for runs from before the tag."""
        return outside_load.parse(self.tags.get(outside_load.TAG))

    @property
    def under_load(self) -> str:
        """The outside load in words when the run trained under it (:func:`onegpu.measure.outside_load.describe`),
        else ''."""
        info = self.outside_load
        return outside_load.describe(info) if outside_load.under_load(info) else ""

    @property
    def partial_steps(self) -> list[dict]:
        """Optimizer steps that saw fewer examples than the effective batch: from the tag
        ``onegpu.partial_steps``, else the ``step_examples`` series; ``[{"step", "examples", ...}]``."""
        raw = self.tags.get("onegpu.partial_steps")
        if raw:
            try:
                return list(json.loads(raw))
            except ValueError:
                pass
        eff = self.effective_batch
        return [{"step": s, "examples": int(v), "effective_batch": eff}
                for s, v in self.series.get("step_examples", []) if eff and v < eff]

    @property
    def key(self) -> str | None:
        """The ``equivalence_key`` tag (None when the run has none)."""
        return self.tags.get(KEY_TAG) or None

    @property
    def label(self) -> str:
        """The run name, else the first 8 characters of its id."""
        return self.name or self.run_id[:8]

    @property
    def layout(self) -> tuple[int | None, int | None, int | None]:
        """``(micro-batch, accumulation, processes)`` as resolved by the train stage."""
        return self.micro_batch, self.accumulation, as_int(self.params.get("resolved.world_size",
                                                                           self.params.get("train.num_processes")))

    @property
    def micro_batch(self) -> int | None:
        """Examples per micro-batch (forward/backward pass), as resolved by the train stage."""
        return as_int(self.params.get(RESOLVED_MICRO_BATCH, self.params.get("train.per_device_train_batch_size")))

    @property
    def accumulation(self) -> int | None:
        """Micro-batches per optimizer step."""
        return as_int(self.params.get(RESOLVED_ACCUMULATION, self.params.get("train.gradient_accumulation_steps")))

    @property
    def effective_batch(self) -> int | None:
        """Examples per optimizer step."""
        v = as_int(self.params.get(RESOLVED_EFFECTIVE_BATCH))
        if v is None and self.micro_batch and self.accumulation:
            v = self.micro_batch * self.accumulation
        return v

    @property
    def checkpointing(self) -> bool:
        """Activation (gradient) checkpointing on."""
        return _bool(self.params.get("train.gradient_checkpointing", False))

    @property
    def precision(self) -> str:
        """``bf16``, ``fp16`` (mixed precision), ``tf32`` (``train.tf32`` on a device other than ``cpu``,
        as tagged; TF32 is a no-op on CPU) or ``fp32``."""
        if _bool(self.params.get("train.bf16", False)):
            return "bf16"
        if _bool(self.params.get("train.fp16", False)):
            return "fp16"
        if _bool(self.params.get("train.tf32", False)) and self.tags.get("device", "").lower() != "cpu":
            return "tf32"
        return "fp32"

    @property
    def split(self) -> str:
        """``micro x accumulation``, with `` ckpt`` when checkpointing is on (e.g. ``4x16 ckpt``)."""
        s = f"{self.micro_batch if self.micro_batch is not None else '?'}x" \
            f"{self.accumulation if self.accumulation is not None else '?'}"
        return s + (" ckpt" if self.checkpointing else "")

    @property
    def peak_memory_bytes(self) -> float | None:
        """Peak memory during training, bytes (``train_mem_peak_bytes``; else the largest per-step peak)."""
        v = self.metrics.get("train_mem_peak_bytes")
        if v is None and self.series.get("mem_peak_bytes"):
            v = max(x for _, x in self.series["mem_peak_bytes"])
        return v

    @property
    def samples_per_second(self) -> float | None:
        """Training throughput, examples per second (``train_samples_per_second``; else the per-step mean)."""
        v = self.metrics.get("train_samples_per_second")
        if v is None and self.series.get("samples_per_second"):
            xs = [x for _, x in self.series["samples_per_second"]]
            v = sum(xs) / len(xs)
        return v

    @property
    def mean_step_time_s(self) -> float | None:
        """Mean wall time of an optimizer step, seconds (all its micro-batches)."""
        xs = [x for _, x in self.series.get("step_time_s", [])]
        return sum(xs) / len(xs) if xs else None

    @property
    def steps(self) -> int:
        """Optimizer steps with a logged loss."""
        return len(self.series.get("loss", []))

    @property
    def still_training(self) -> bool:
        """RUNNING without the train-end summary (``train_runtime``): its training process is still writing
        steps, so comparing its curve now would report a spurious step-count difference. (A run that
        evaluate has re-opened is RUNNING too, but its training is complete: it is compared.)"""
        return self.status == "RUNNING" and "train_runtime" not in self.metrics


def finished_training(records: list[RunRecord], where: str, filters: dict[str, object]) -> list[RunRecord]:
    """``records`` without the runs still training (each named in one printed line).

    ``where``: the experiment and store, for the message; ``filters``: the command's options that
    selected the runs (``{"--key": ...}``; None or empty when not given).
    Raises:
        UserError: every matching run is still training, or none matched.
    """
    training = [r for r in records if r.still_training]
    for r in training:
        steps = max((s for s, _ in r.series.get("loss", [])), default=0)
        print(f"left out: MLflow run {r.name or r.run_id} ({r.run_id}) is still training ({steps} optimizer "
              "steps logged so far); compare again when it has finished")
    if training and len(training) == len(records):
        raise UserError(f"the {len(records)} matching training run(s) are all still training: nothing to "
                        "compare yet")
    kept = [r for r in records if not r.still_training]
    if not kept:
        given = [f"{name} {' '.join(v) if isinstance(v, list) else v}" for name, v in filters.items() if v]
        raise UserError(f"no training runs in {where}" + (f" matching {', '.join(given)}" if given else "")
                        + ": train first (`dvc repro`, `dvc exp run -S ...`)")
    return kept

