"""``onegpu train``: fine-tune on data/processed -> models/, metrics/train.json, plots/{train,eval}_steps.csv.

Opens the training run (one per training configuration) and ends it when the stage ends: SCHEDULED (trained;
its evaluation still to come), or FAILED/KILLED on an error or a stop. ``evaluate`` re-opens the same run, logs
into it and ends it FINISHED; the run id is kept in ``models/mlflow_run.json``. No run is RUNNING unless a
process writes to it. The run itself: :mod:`onegpu.training.tracked_run`."""
from __future__ import annotations

import sys
from dataclasses import asdict

from onegpu import paths, tracking
from onegpu.config import Config
from onegpu.equivalence.key import run_config_hash
from onegpu.measure import outside_load
from onegpu.models import lora
from onegpu.training import objectives, prepared, session, tracked_run
from onegpu.training.parallel import distributed, machines
from onegpu.training.record import recorder

# metrics/train.json (`dvc exp show`, `dvc metrics diff`): these headline figures only, so a sweep's table fits a
# terminal next to the params that vary; the rest (runtime, memory breakdown, FLOP/s, MFU, resolved.*, per-step series)
# is in the MLflow run. Under outside load: train_outside_cpu_load too (CPUs others kept busy, onegpu.outside_load).
HEADLINE = ("train_loss", "train_samples_per_second", "train_mem_peak_bytes")
# plots/train_steps.csv: one row per optimizer step (dvc.yaml's plots: loss, memory in MiB, speed).
STEP_COLUMNS = ["step", "loss", "grad_norm", "learning_rate", "step_time_s", "samples_per_second",
                "tokens_per_second", "mem_peak_bytes", "mem_peak_mib"]
# plots/eval_steps.csv: a row per validation point (the loss chart draws eval_loss); a figure the task lacks is empty.
EVAL_COLUMNS = ["step", "eval_loss", "eval_accuracy", "eval_f1_macro", "eval_perplexity", "eval_mean_token_accuracy",
                "eval_pass_rate", "eval_runtime", "eval_mem_peak_bytes"]


def run(cfg: Config) -> dict:
    if cfg.train.num_processes > 1 and not distributed.launched():  # launch N processes of this stage
        session.plan(cfg)  # the device, precision and data checks once, before any process starts
        t, rdzv_id = cfg.train, "onegpu-" + run_config_hash(cfg)  # alike on every machine (no machine keys)
        return distributed.launch(t.num_processes, sys.argv[1:], distributed.Machines(
            t.num_machines, t.machine_rank, t.main_process_ip, t.main_process_port, rdzv_id)) or {}
    distributed.check_world(cfg.train.num_processes)
    plan = session.plan(cfg)  # device and precision checks first, then data/stats.json
    machines.agree(plan.checkpoint_dir, plan.resume, cfg.train.fsdp.enabled)  # several machines: folders, resume
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()  # no "Writing model shards" bar between progress lines (checkpoints, models/)
    main = distributed.is_main()  # rank 0 alone writes MLflow and the outputs
    tracker = tracking.connect(cfg.tracking.experiment_name) if main else distributed.NullTracker()
    with distributed.failure_note():
        result = tracked_run.run(plan, tracker, prepared.load_processed(), save=_write_outputs if main else None)
    distributed.print_main(recorder.closing_line(result.summary, result.plan.resolved, result.plan.device,
                                                 result.plan.budget, result.run_id,
                                                 objectives.of(cfg).start_words(cfg)[0]))
    return result.summary


def _write_outputs(result: tracked_run.TrainResult) -> None:
    """models/ (model, tokenizer, run file; with model.lora also adapter/), plots/train_steps.csv,
    plots/eval_steps.csv and metrics/train.json, each atomically."""
    model = lora.save(result.model, result.tokenizer, paths.ADAPTER_DIR)  # the merged model is what evaluate loads
    with paths.atomic_dir(paths.MODEL_DIR) as tmp:
        _save_model(model, tmp, result.saved_config)
        result.tokenizer.save_pretrained(tmp)
    paths.write_csv_atomic(paths.STEP_PLOT, STEP_COLUMNS,
                           ([{**r, "mem_peak_mib": round(r["mem_peak_bytes"] / 2**20, 1)}.get(c, "")
                             for c in STEP_COLUMNS] for r in result.steps.rows))
    paths.write_csv_atomic(paths.EVAL_PLOT, EVAL_COLUMNS, ([p.get(c, "") for c in EVAL_COLUMNS]
                                                           for p in result.steps.evals))
    headline = {k: result.summary[k] for k in HEADLINE if k in result.summary}
    if outside_load.under_load(result.outside_load):  # a caution beside the speed, only when there is one
        headline[outside_load.METRIC] = result.outside_load["cpu_busy"]
    paths.write_json_atomic(paths.TRAIN_METRICS, headline)
    paths.write_json_atomic(paths.RUN_FILE, tracking.run_record(result.run_id, result.experiment_id, result.plan.key,
                                                                paths.tracking_uri(), tracking.run_name(),
                                                                result.model_spec and asdict(result.model_spec)))


def _save_model(model, directory, config_values: dict) -> None:
    """``save_pretrained`` (safetensors) with ``config_values`` (e.g. ``use_cache`` as the model had it
    before training switched it off) set back on the model's config first."""
    for k, v in config_values.items():
        setattr(model.config, k, v)
    model.save_pretrained(directory)
