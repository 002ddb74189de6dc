"""The trained model as an MLflow 3 logged model whose files stay where DVC keeps them (``models/``).

MLflow 3's run page leads with a run's logged models and its Models tab lists an experiment's models
with the metrics linked to them. :func:`create` records a model the way ``mlflow.create_external_model``
does (MLflow's own recipe for a model stored outside MLflow: the tag ``mlflow.model.isExternal``, a
one-file ``MLmodel`` of a few hundred bytes so the registry can take it, status READY), through this
store's client instead of the global one, and links it to its training run as the run's output.
:func:`find` looks one up by its training run. No model bytes are copied into the store.
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field

IS_EXTERNAL = "mlflow.model.isExternal"  # mlflow.utils.mlflow_tags.MLFLOW_MODEL_IS_EXTERNAL
# The DVC-tracked version of the model's files, ``models@<md5>.dir`` (``dvc get`` / ``dvc exp apply`` bring
# them back); the same tag name as a dataset input's (runs.DVC_OUT_TAG). MODELS: train's DVC output.
DVC_OUT_TAG, MODELS = "onegpu.dvc_out", "models"


@dataclass
class ModelSpec:
    """What MLflow records of a trained model: ``name`` (the Models tab's), ``params`` (what defines it,
    strings), ``tags`` (where its files are) and ``model_type`` (e.g. the task)."""
    name: str
    params: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    model_type: str | None = None


def locked(fields: dict) -> ModelSpec:
    """The logged model train recorded (``fields``: a :class:`ModelSpec`'s, from ``models/mlflow_run.json``),
    with :data:`DVC_OUT_TAG` = ``models@<md5>.dir`` where dvc.lock holds train's own hash of ``models``: under
    DVC (it sets ``DVC_STAGE``), which locks train before it runs evaluate; by hand the lock may be older."""
    from onegpu import paths
    spec = ModelSpec(**fields)
    if os.environ.get("DVC_STAGE") and (md5 := paths.dvc_out_hash(MODELS)):
        spec.tags = {**spec.tags, DVC_OUT_TAG: f"{MODELS}@{md5}"}
    return spec


def create(client, experiment_id: str, run_id: str, spec: ModelSpec) -> str:
    """Create the logged model of ``spec`` in ``experiment_id``, its source run ``run_id``, READY, and log
    it as that run's output (step 0). Five store calls; the only artifact is the ``MLmodel`` file.
    Returns the model id (``m-<hex>``). Raises what the MLflow client raises."""
    from mlflow.entities import LoggedModelOutput
    from mlflow.models.model import MLMODEL_FILE_NAME
    from mlflow.models.utils import get_external_mlflow_model_spec
    model = client.create_logged_model(experiment_id, name=spec.name, source_run_id=run_id,
                                       tags={**spec.tags, IS_EXTERNAL: "true"},
                                       params={k: str(v) for k, v in spec.params.items()},
                                       model_type=spec.model_type)
    with tempfile.TemporaryDirectory(prefix="onegpu-mlmodel-") as tmp:
        _quiet_signature(lambda: get_external_mlflow_model_spec(model)).save(os.path.join(tmp, MLMODEL_FILE_NAME))
        client.log_model_artifacts(model.model_id, tmp)
    client.finalize_logged_model(model.model_id, "READY")
    client.log_outputs(run_id, [LoggedModelOutput(model.model_id, 0)])
    return model.model_id


def _quiet_signature(build):
    """``build()`` without the integer-column hint MLflow's signature inference prints (a placeholder
    signature of one boolean here, MLflow's for external models)."""
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return build()


def find(client, experiment_id: str, run_id: str) -> str | None:
    """The id of the newest READY logged model of ``experiment_id`` whose source run is ``run_id``, or
    None when there is none. Raises what the MLflow client raises."""
    found = client.search_logged_models([experiment_id], filter_string=f"source_run_id = '{run_id}'",
                                        order_by=[{"field_name": "creation_timestamp", "ascending": False}],
                                        max_results=10)
    ready = [m for m in found if str(getattr(m.status, "name", m.status)).endswith("READY")]
    return ready[0].model_id if ready else None
