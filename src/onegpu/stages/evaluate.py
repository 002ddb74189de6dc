"""``onegpu evaluate``: the trained model on the test split -> metrics/eval.json, plots/predictions.csv.

Re-opens the training run (id from ``models/mlflow_run.json``; train ended it), logs into it and
ends it again (FINISHED, or FAILED/KILLED); a model trained in another clone whose run this store does
not have (a pulled experiment) is logged into a run linked to it instead
(:func:`onegpu.tracking.open_evaluation_run`). It logs ``test_loss``,
``test_accuracy``, ``test_f1_macro`` (classification) or ``test_perplexity`` and ``test_mean_token_accuracy``
(causal LM), ``test_runtime`` (s), ``test_samples_per_second``, ``test_mem_peak_bytes`` (HF
``Trainer.predict``'s ``test_`` prefix: the training run's ``eval_*`` are the validation split's), and for
classification a confusion matrix image.
"""
from __future__ import annotations

from onegpu import evaluation, paths, tracking
from onegpu.config import Config, flatten
from onegpu.data import describe
from onegpu.errors import DataError
from onegpu.measure import memory
from onegpu.models import loader

# metrics/eval.json (`dvc exp show`, `dvc metrics diff`): the headline figures only (the rest: the MLflow run).
HEADLINE = ("test_loss", "test_accuracy", "test_perplexity", "test_rouge_l", "test_rewards/accuracies",
            "test_reference_accuracy", "test_rewards/margins", "test_pass_rate", "test_start_pass_rate",
            "test_reward", "test_start_reward")


def run(cfg: Config) -> dict:
    if not paths.RUN_FILE.is_file():
        raise DataError(f"{paths.RUN_FILE} is missing: run the train stage first (dvc repro)")
    record = paths.read_json(paths.RUN_FILE)
    tracker = tracking.connect(cfg.tracking.experiment_name)
    task = cfg.model.task
    run_id, reproduces = tracking.open_evaluation_run(tracker, record, flatten(cfg.to_dict()))
    with tracker.guard(run_id, finish=True, note=evaluation.failure_note):
        from datasets import load_from_disk
        from transformers.utils import logging as hf_logging
        hf_logging.disable_progress_bar()  # no "Loading weights" bar in the pipeline's output

        model, tokenizer = loader.load_trained(paths.MODEL_DIR, task)
        evaluation.as_trained(model, cfg)  # the output layer as training ran it (train.fused_lm_head)
        processed = load_from_disk(str(paths.PROCESSED))
        test, test_input = processed["test"], None
        if (fmt := paths.read_json(paths.STATS).get("format") if paths.STATS.is_file() else None) is not None:
            [test_input] = tracker.log_data_inputs(
                run_id, describe.inputs(processed, fmt, cfg.data.source, {"test": "evaluation"}), paths.dvc_version())
        model_id = (tracker.log_model(run_id, tracking.models.locked(record["logged_model"]))  # train's, or made now
                    if record.get("logged_model") else None)
        device = memory.default_device()
        if reproduces:  # the training run's tag names the device it trained on; this one evaluated here
            tracker.set_tags(run_id, {"device": memory.device_name(device)})
        memory.reset_peak(device)
        with tracker.system_metrics(run_id, resume=True):
            metrics, table, gold, pred = evaluation.metrics(model, tokenizer, test, cfg, device)
        metrics["test_mem_peak_bytes"] = memory.peak_bytes(device)
        tracker.log_metrics(run_id, metrics, model_id=model_id, dataset=test_input)  # the run's and the model's
        names = test.features["label"].names
        if gold:
            tracker.log_figure(run_id, evaluation.confusion_figure(gold, pred, names), "confusion_matrix.png")
        if table is not None:
            tracker.log_table(run_id, table, "generations.json")
        paths.write_json_atomic(paths.EVAL_METRICS, {k: metrics[k] for k in HEADLINE if k in metrics})
        _write_predictions(gold, pred, names)
        paths.write_csv_atomic(paths.GENERATIONS, ["reference", "generation", "rouge_l"],
                               zip(*(table[k] for k in ("reference", "generation", "rouge_l"))) if table else [])
    if reproduces:
        print(f"evaluate: the training run {reproduces} is not in this MLflow store (trained in another clone); "
              f"run {run_id} here reproduces it (tag {tracking.REPRODUCES_RUN_ID})")
    if table is not None:
        print(evaluation.generations_text(table, metrics, cfg.evaluate.max_new_tokens))
    print(evaluation.result_line(task, metrics, run_id))
    print(evaluation.NEXT)  # where to look next after a plain `dvc repro`
    return metrics


def _write_predictions(gold, pred, names) -> None:
    """plots/predictions.csv (actual, predicted label names): DVC's confusion plot reads it.

    Causal LM has no classes: the file then holds the header alone."""
    paths.write_csv_atomic(paths.PREDICTIONS, ["actual", "predicted"],
                           ((names[g], names[p]) for g, p in zip(gold, pred)))
