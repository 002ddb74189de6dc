"""Check a project's MLflow store after ``dvc repro``: what the pipeline promises to log (README, "What is
logged") is there, for every run, at every optimizer step.

Rules (names, steps and placement, not the values' correctness):

* a prepare run (tag ``stage=prepare``) with ``prepare_runtime``, ``prepare_rows_per_second``,
  ``prepare_mem_peak_bytes``;
* every training run (one with ``train_runtime``): each per-step metric of :data:`STEP_METRICS` logged
  at optimizer steps 1..N once each, the same steps for all of them; the summary metrics
  :data:`TRAIN_SUMMARY` (peak memory among them); the ``resolved.*`` params, ``train.*`` params and the
  tags :data:`TAGS`; artifacts outside DVC's temporary clones;
* the runs are ``FINISHED`` (train leaves its run SCHEDULED, evaluate finishes it) with the evaluate
  metrics :data:`EVAL_SUMMARY`, when ``--finished`` (as after a whole ``dvc repro``);
* lineage: every training run has dataset inputs of the contexts ``training`` and ``validation`` with the
  names and digests prepare's run logged, each tagged with its DVC version; a finished one also the
  ``evaluation`` input and one READY external logged model of its own (its ``equivalence_key`` param the
  run's, no artifact but MLflow's ``MLmodel``) whose metrics include :data:`EVAL_SUMMARY` on that input.

Run as ``python -m bench.store_check [PROJECT_ROOT] [--experiment onegpu] [--finished] [--json OUT]``: one
line per problem and exit 1 when there is any, else a summary line and exit 0. Only reads the store.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

STEP_METRICS = ("loss", "grad_norm", "learning_rate", "step_time_s", "samples_per_second",
                "tokens_per_second", "mem_peak_bytes")
TRAIN_SUMMARY = ("train_loss", "train_runtime", "train_samples_per_second", "train_tokens_per_second",
                 "train_mem_peak_bytes")
EVAL_SUMMARY = ("test_loss", "test_runtime", "test_samples_per_second", "test_mem_peak_bytes")
PREPARE = ("prepare_runtime", "prepare_rows_per_second", "prepare_mem_peak_bytes")
RESOLVED = ("resolved.per_device_train_batch_size", "resolved.gradient_accumulation_steps",
            "resolved.effective_batch_size", "resolved.world_size")
TAGS = ("equivalence_key", "device", "mlflow.source.git.commit")
DVC_TMP = "/.dvc/tmp/"
INPUT_CONTEXTS = ("training", "validation")


def _missing(have, wanted) -> list[str]:
    return [k for k in wanted if k not in have]


def _step_problems(client, run, rid: str) -> tuple[list[str], int]:
    """Problems of one training run's per-step series, and its number of optimizer steps."""
    out, steps = [], {}
    for k in STEP_METRICS:
        steps[k] = sorted(m.step for m in client.get_metric_history(run.info.run_id, k))
        if not steps[k]:
            out.append(f"{rid}: per-step metric {k} missing")
    ref = steps["loss"]
    if ref and ref != list(range(1, len(ref) + 1)):
        out.append(f"{rid}: loss steps are not 1..N once each: {ref[:10]}")
    out += [f"{rid}: {k} steps differ from loss steps" for k, s in steps.items() if s and s != ref]
    return out, len(ref)


def _training_problems(client, run, finished: bool) -> tuple[list[str], dict]:
    """Problems of one training run, and its facts for the summary."""
    rid = f"{run.info.run_name or ''} {run.info.run_id[:8]}".strip()
    out, n_steps = _step_problems(client, run, rid)
    m, params, tags = run.data.metrics, run.data.params, run.data.tags
    if DVC_TMP in (run.info.artifact_uri or ""):
        out.append(f"{rid}: artifacts inside a DVC temporary clone: {run.info.artifact_uri}")
    if miss := _missing(m, TRAIN_SUMMARY):
        out.append(f"{rid}: summary metrics missing {miss}")
    if miss := _missing(params, RESOLVED):
        out.append(f"{rid}: params missing {miss}")
    if not any(k.startswith("train.") for k in params):
        out.append(f"{rid}: params.yaml leaves (train.*) not logged")
    if miss := [k for k in TAGS if not tags.get(k)]:
        out.append(f"{rid}: tags missing {miss}")
    if finished and run.info.status != "FINISHED":
        out.append(f"{rid}: status {run.info.status}, not FINISHED (evaluate finishes the run)")
    if run.info.status == "FINISHED" and (miss := _missing(m, EVAL_SUMMARY)):
        out.append(f"{rid}: finished but evaluate metrics missing {miss}")
    facts = {"run": rid, "status": run.info.status, "steps": n_steps, "device": tags.get("device"),
             **{k: m.get(k) for k in (*TRAIN_SUMMARY, "test_loss", "test_accuracy")}}
    return out, facts


def _input_problems(run, rid: str, prepared: dict[str, str], finished: bool) -> tuple[list[str], dict]:
    """Problems of a training run's dataset inputs, and its inputs as ``{context: (name, digest)}``."""
    got = {}
    for d in run.inputs.dataset_inputs:
        tags = {t.key: t.value for t in d.tags}
        got[tags.get("mlflow.data.context")] = (d.dataset.name, d.dataset.digest, tags.get("onegpu.dvc_out"))
    out = [f"{rid}: dataset input {c} missing" for c in (*INPUT_CONTEXTS, *(("evaluation",) if finished else ()))
           if c not in got]
    for context, (name, digest, dvc_out) in got.items():
        if name in prepared and prepared[name] != digest:
            out.append(f"{rid}: dataset {name} ({context}) has digest {digest}, prepare's run logged {prepared[name]}")
        if not dvc_out:
            out.append(f"{rid}: dataset {name} ({context}) has no onegpu.dvc_out tag (its DVC version)")
    return out, {c: (n, d) for c, (n, d, _) in got.items()}


def _model_problems(client, run, rid: str, test: tuple[str, str] | None) -> list[str]:
    """Problems of a finished training run's logged model: there is one, READY, external, of this run's
    equivalence key, with the eval metrics on the run's evaluation input and no model bytes in the store."""
    models = client.search_logged_models([run.info.experiment_id],
                                         filter_string=f"source_run_id = '{run.info.run_id}'")
    if len(models) != 1:
        return [f"{rid}: {len(models)} logged models, not 1"]
    m = models[0]
    out = [] if str(m.status).endswith("READY") else [f"{rid}: logged model status {m.status}"]
    if m.tags.get("mlflow.model.isExternal") != "true":
        out.append(f"{rid}: logged model is not external (its files are meant to stay in DVC)")
    if m.params.get("equivalence_key") != run.data.tags.get("equivalence_key"):
        out.append(f"{rid}: logged model's equivalence_key differs from the run's")
    linked = {x.key: (x.dataset_name, x.dataset_digest) for x in m.metrics}
    if miss := [k for k in EVAL_SUMMARY if k not in linked]:
        out.append(f"{rid}: logged model lacks eval metrics {miss}")
    if test and any(linked[k] != test for k in EVAL_SUMMARY if k in linked):
        out.append(f"{rid}: logged model's eval metrics are not linked to the evaluation input {test[0]}")
    files = [a.path for a in client.list_logged_model_artifacts(m.model_id)]
    if files != ["MLmodel"]:
        out.append(f"{rid}: logged model has artifacts {files} in the store (only MLmodel is expected)")
    return out


def check(root: Path, experiment: str = "onegpu", finished: bool = False) -> tuple[list[str], dict]:
    """``(problems, facts)`` for the store of the project at ``root`` (``MLFLOW_TRACKING_URI`` if set,
    else ``sqlite:///<root>/mlflow.db``); ``facts`` holds the runs found, for a report."""
    import mlflow
    from mlflow.tracking import MlflowClient
    uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{root.resolve()}/mlflow.db"
    if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///"):]).exists():
        return [f"no store at {uri}"], {}
    mlflow.set_tracking_uri(uri)
    client = MlflowClient()
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return [f"no experiment named {experiment!r} in {uri}"], {}
    problems = []
    if DVC_TMP in exp.artifact_location:
        problems.append(f"experiment artifact location is inside a DVC temporary clone: {exp.artifact_location}")
    runs = client.search_runs([exp.experiment_id], max_results=5000)
    prep = [r for r in runs if r.data.tags.get("stage") == "prepare"]
    train = [r for r in runs if "train_runtime" in r.data.metrics]
    problems += [] if prep else ["no prepare run (tag stage=prepare)"]
    problems += [] if train else ["no training run (one with train_runtime)"]
    problems += [f"prepare run {r.info.run_id[:8]} lacks {miss}"
                 for r in prep if (miss := _missing(r.data.metrics, PREPARE))]
    facts = {"uri": uri, "experiment": experiment, "prepare_runs": len(prep), "training_runs": []}
    prepared = {d.dataset.name: d.dataset.digest for r in prep for d in r.inputs.dataset_inputs}
    for r in train:
        p, f = _training_problems(client, r, finished)
        inputs, got = _input_problems(r, f["run"], prepared, finished)
        if finished:
            p += _model_problems(client, r, f["run"], got.get("evaluation"))
        problems += p + inputs
        facts["training_runs"].append(f)
    return problems, facts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.store_check", description=__doc__.splitlines()[0])
    p.add_argument("root", nargs="?", default=".", type=Path)
    p.add_argument("--experiment", default="onegpu")
    p.add_argument("--finished", action="store_true", help="every training run must be FINISHED")
    p.add_argument("--json", type=Path, help="write the problems and the runs found here")
    a = p.parse_args(argv)
    problems, facts = check(a.root, a.experiment, a.finished)
    if a.json:
        a.json.write_text(json.dumps({"problems": problems, **facts}, indent=1, default=str) + "\n")
    for line in problems:
        print(f"store_check: {line}")
    if problems:
        return 1
    runs = facts["training_runs"]
    print(f"store_check: ok: {facts['prepare_runs']} prepare run(s), {len(runs)} training run(s) in "
          f"{a.experiment!r}: " + "; ".join(f"{r['run']} {r['status']}, {r['steps']} steps on {r['device']}"
                                            for r in runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
