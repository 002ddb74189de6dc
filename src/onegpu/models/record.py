"""What MLflow records of a trained model (:class:`onegpu.tracking.ModelSpec`): the params that define it and
the tags that say where its files are. Train records it when it saves ``models/`` (and keeps it in
``models/mlflow_run.json``); evaluate records it again with the hash DVC gave ``models``
(:func:`onegpu.tracking.models.locked`)."""
from __future__ import annotations

import os

from onegpu import paths
from onegpu.config import Config
from onegpu.tracking.models import ModelSpec

# The logged model's tags: the folder that holds it (what evaluate loads), the LoRA adapter's folder and the
# base it was fine-tuned from (evaluate adds the DVC-tracked version, tracking.models.DVC_OUT_TAG).
MODEL_DIR_TAG, ADAPTER_TAG, BASE_TAG = "onegpu.model_dir", "onegpu.adapter_dir", "onegpu.base_model"


def logged_model(cfg: Config, equivalence_key: str, name: str) -> ModelSpec:
    """The logged model of a training of ``cfg``, named ``name`` (the run's), with ``equivalence_key``.

    Params: ``equivalence_key``, ``base_model`` (``model.name_or_path``, or "from config" for a model built
    from params), ``task``, ``finetuning`` (``full``, or ``lora`` with ``lora.r``, ``lora.alpha`` and
    ``lora.target_modules``), ``precision`` (``fp32``, ``bf16``, ``fp16``), ``data.source``,
    ``effective_batch_size``, ``learning_rate``. Tags: :data:`MODEL_DIR_TAG`, :data:`BASE_TAG`, with LoRA
    :data:`ADAPTER_TAG`, and ``dvc.exp_name`` under ``dvc exp run``. Train keeps it in ``models/mlflow_run.json``
    too, so evaluate records the same model where train could not (:func:`onegpu.tracking.models.locked`).
    """
    m, t = cfg.model, cfg.train
    base = str(m.name_or_path) if m.name_or_path else f"from config ({m.task})"
    lora = m.lora_adapters
    params = {"equivalence_key": equivalence_key, "base_model": base, "task": m.task,
              "finetuning": "lora" if lora else "full",
              "precision": {"no": "fp32"}.get(t.mixed_precision, t.mixed_precision),
              "data.source": str(cfg.data.source), "effective_batch_size": str(t.effective_batch_size),
              "learning_rate": str(t.learning_rate)}
    if lora:
        params.update({"lora.r": str(lora.r), "lora.alpha": str(lora.alpha),
                       "lora.target_modules": str(lora.target_modules or "peft's default")})
    tags = {MODEL_DIR_TAG: str(paths.MODEL_DIR), BASE_TAG: base}
    if lora:
        tags[ADAPTER_TAG] = str(paths.ADAPTER_DIR)
    if os.environ.get("DVC_EXP_NAME"):
        tags["dvc.exp_name"] = os.environ["DVC_EXP_NAME"]
    return ModelSpec(name=name, params=params, tags=tags, model_type=m.task)
