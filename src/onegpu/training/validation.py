"""Validation during training: the validation split evaluated after chosen optimizer steps and at the end,
with the evaluate stage's code (:func:`onegpu.training.objectives.validation_metrics`: exact over the split), by
both backends alike.

When (HF ``TrainingArguments``' names and meanings): ``train.eval_strategy`` ``steps`` validates after
every ``train.eval_steps`` optimizer steps (below 1: that share of the run's steps, rounded up, as HF's
``TrainingArguments`` does), ``epoch`` after each epoch's last step, ``no`` never; with ``steps`` or
``epoch`` the run's last step is validated too. A backend hands a :class:`Validation` to its
:class:`onegpu.training.record.recorder.StepRecorder`, which runs it after the step's own metrics and keeps its time
and peak memory out of the steps' (``eval_runtime``, ``eval_mem_peak_bytes`` are its own).

Validation changes nothing of the training: the model is put in eval mode under ``torch.no_grad()`` and
back in its mode afterwards, and the random number generators are restored afterwards
(``torch.random.fork_rng``; a DataLoader draws its base seed from the global generator when it is
iterated), so the steps' losses, gradient norms and weights are bit-equal with validation on or off
(``tests/unit/training/test_validation.py``). Under several processes each validates its contiguous share
of the split (:func:`onegpu.training.objectives.heldout.shard`: every row once) and the sums are all-reduced, so every
process holds the one-process figures.
"""
from __future__ import annotations

import math

from onegpu.config import Config
from onegpu.errors import ConfigError
from onegpu.training.parallel import distributed


def interval(cfg: Config, total_steps: int, steps_per_epoch: int) -> int | None:
    """Optimizer steps between two validation points (None: ``eval_strategy: no``).

    ``train.eval_steps`` below 1 is a share of ``total_steps``, rounded up (HF:
    ``TrainingArguments.eval_steps``, "a ratio of total training steps").
    Raises:
        ConfigError: an ``eval_steps`` of more optimizer steps than the run has.
    """
    t = cfg.train
    if t.eval_strategy == "no":
        return None
    if t.eval_strategy == "epoch":
        return steps_per_epoch
    if t.eval_steps < 1:
        return max(math.ceil(t.eval_steps * total_steps), 1)
    if t.eval_steps > total_steps:
        raise ConfigError(f"params.yaml: train.eval_steps: {int(t.eval_steps)} optimizer steps is more than the "
                          f"run's {total_steps}; set it to at most {total_steps}, or a share of the run below 1 "
                          "(e.g. 0.25)")
    return int(t.eval_steps)


class Validation:
    """The validation split's figures (``eval_*``) after the steps :meth:`due` names, the best point so far
    and early stopping.

    ``model``: the model being trained, unwrapped (not DDP's wrapper): its own forward, under no_grad;
    ``dataset``: the prepared validation split; ``device``: where the model is; ``every``: steps between
    points (:func:`interval`); ``best_dir``: where ``train.load_best_model_at_end`` keeps the best point's
    weights (a file on disk, not a second copy in memory; None: a temporary folder).
    """

    def __init__(self, model, tokenizer, dataset, cfg: Config, device, every: int, total_steps: int,
                 best_dir=None) -> None:
        self.model, self.tokenizer, self.dataset, self.cfg = model, tokenizer, dataset, cfg
        self.device, self.every, self.total_steps = str(device), every, total_steps
        self._best_dir, self._scratch = best_dir, None
        self.best_bytes = 0  # bytes of the best point's weights on disk (train.load_best_model_at_end)

    def is_point(self, step: int) -> bool:
        """Whether optimizer ``step`` is followed by a validation point (every ``every`` steps, and the last):
        every process then validates its share of the split."""
        return step % self.every == 0 or step == self.total_steps

    def __call__(self, step: int) -> dict:
        """The split's ``eval_*`` figures with the weights after ``step`` (:func:`onegpu.training.objectives.
        validation_metrics`); the model's mode and every random number generator as they were."""
        import torch

        from onegpu.training import objectives
        was_training = self.model.training
        devices = [self.device] if self.device.startswith("cuda") else []
        try:
            with torch.random.fork_rng(devices=devices):
                metrics = objectives.validation_metrics(self.model, self.tokenizer, self.dataset, self.cfg,
                                                        self.device)
        finally:
            self.model.train(was_training)
        return metrics

    def after(self, step: int, evals: list[dict]) -> str | None:
        """After ``step``'s point (``evals``: every point so far, this one last): keep the weights when it is
        the best (``train.load_best_model_at_end``), and early stopping's sentence when the run stops here
        (all processes agree), else None."""
        if not self.is_point(step):
            return None
        t = self.cfg.train
        best, waited = best_point(evals, t.metric_for_best_model, greater(t), t.early_stopping_threshold)
        if t.load_best_model_at_end and best is not None and best["step"] == step:  # (all-reduced: on every rank)
            self._save_best()
        patience = t.early_stopping_patience
        stop = patience is not None and waited >= patience and step < self.total_steps
        if distributed.world_size() > 1:  # the same all-reduced figures on every process: a stop agreed anyway
            stop = distributed.any_rank(stop, self.device)
        if not stop:
            return None
        return (f"early stopping after optimizer step {step} of {self.total_steps}: {t.metric_for_best_model} has "
                f"not improved by more than {t.early_stopping_threshold:g} for {t.early_stopping_patience} "
                f"validation point(s) (train.early_stopping_patience); the best, {best[t.metric_for_best_model]:.6g}, "
                f"was at step {best['step']}")

    def _best_file(self) -> str:
        import os
        import tempfile
        if self._best_dir is None:
            self._scratch = self._scratch or tempfile.TemporaryDirectory(prefix="onegpu-best-")
            return os.path.join(self._scratch.name, BEST_FILE)
        os.makedirs(self._best_dir, exist_ok=True)
        return os.path.join(str(self._best_dir), BEST_FILE)

    def _save_best(self) -> None:
        """The model's weights to disk by process 0, atomically: on a GPU through a host copy freed once written
        (nothing more on the device), on a CPU the state dict's own tensors (no copy), so no second copy of the
        model stays in memory; their bytes are :attr:`best_bytes` (the breakdown's ``mem_best_model_bytes``).
        Every process calls it: under ``train.fsdp`` the whole weights are gathered from all (a collective)."""
        import os

        import torch

        from onegpu.measure import memory
        from onegpu.training.parallel import sharding
        if sharding.is_sharded(self.model):  # train.fsdp: every rank sends its shards, rank 0 gets the whole
            state = sharding.full_state(self.model)
        elif distributed.is_main():
            state = {k: v.detach().cpu() for k, v in self.model.state_dict().items()}
        if not distributed.is_main():  # one writer (under data parallel the ranks' weights are equal)
            return
        path = self._best_file()
        torch.save(state, path + ".tmp")
        self.best_bytes = memory.tensors_bytes(state.values())
        del state
        os.replace(path + ".tmp", path)

    def load_best(self, model, evals: list[dict]) -> dict | None:
        """With ``train.load_best_model_at_end``: the best point's weights loaded into ``model`` (the trained
        model, unwrapped) and that point returned, their bytes in :attr:`best_bytes` (also when an earlier,
        resumed run kept them); None otherwise (or when no point was kept)."""
        import os

        import torch
        t = self.cfg.train
        best, _ = best_point(evals, t.metric_for_best_model, greater(t), t.early_stopping_threshold)
        if not t.load_best_model_at_end or best is None or not os.path.isfile(self._best_file()):
            return None
        from onegpu.training.parallel import sharding
        if sharding.is_sharded(model):  # train.fsdp, a rank but 0: it writes no models/ (rank 0's is gathered)
            return best
        from onegpu.measure import memory
        where = "cpu" if self.device.startswith("cpu") else self.device  # (under train.fsdp a CPU is "cpu:0")
        state = torch.load(self._best_file(), map_location=where, weights_only=True)
        self.best_bytes = memory.tensors_bytes(state.values())
        model.load_state_dict(state)
        return best


BEST_FILE = "best_model.pt"  # the best point's weights (state dict), beside the run's checkpoints


def greater(t) -> bool:
    """``train.greater_is_better``, or HF's default for ``metric_for_best_model``: false for a loss (and a
    perplexity, onegpu's), true for the others."""
    if t.greater_is_better is not None:
        return t.greater_is_better
    return not t.metric_for_best_model.endswith(("loss", "perplexity"))


def best_point(evals: list[dict], metric: str, greater_is_better: bool, threshold: float
               ) -> tuple[dict | None, int]:
    """The best of ``evals`` by ``metric`` (the first of equals) and the points since the last one that
    improved on the best so far by more than ``threshold`` (HF's ``EarlyStoppingCallback``: its patience
    counter), from the points alone, so a resumed run carries both on."""
    best, waited = None, 0
    for point in evals:
        value = point.get(metric)
        if value is None:
            continue
        better = best is None or (value > best[metric] if greater_is_better else value < best[metric])
        waited = 0 if best is None or (better and abs(value - best[metric]) > threshold) else waited + 1
        if better:
            best = point
    return best, waited


def check_plan(cfg: Config, stats: dict) -> None:
    """Before any work (the train stage's plan): an empty validation split, or an ``eval_steps`` of more
    optimizer steps than the run has, refused in one line. ``stats``: data/stats.json (rows per split).
    The run's steps are counted as the backends count them (:func:`onegpu.training.around_steps.
    schedule`) where the plan knows them: a fixed micro-batch, unpacked rows (else the backend checks once
    it knows them).

    Raises:
        ConfigError: as :func:`for_run` would, later.
    """
    splits = stats.get("splits", {})
    if cfg.train.eval_strategy == "no" or not splits:
        return
    if splits.get("validation", {}).get("rows", 1) == 0:
        raise ConfigError(EMPTY)
    micro = cfg.train.per_device_train_batch_size
    if micro == "auto" or cfg.data.packing or "train" not in splits:
        return
    from onegpu.training.around_steps import schedule
    total, per_epoch, _ = schedule(math.ceil(splits["train"]["rows"] / (int(micro) * cfg.train.num_processes)), cfg)
    interval(cfg, total, per_epoch)


EMPTY = ("params.yaml: train.eval_strategy: the validation split is empty (data.validation_size and "
         "data.max_eval_samples leave no rows); raise them, or set train.eval_strategy: no")


def for_run(model, tokenizer, dsd, cfg: Config, device, total_steps: int, steps_per_epoch: int,
            best_dir=None) -> Validation | None:
    """The run's :class:`Validation` (None: ``train.eval_strategy: no``, or ``dsd`` has no ``validation`` split).

    Raises:
        ConfigError: an ``eval_steps`` beyond the run (:func:`interval`), or an empty validation split.
    """
    every = interval(cfg, total_steps, steps_per_epoch)
    if every is None:
        return None
    if "validation" not in dsd:  # a caller's data without one (prepare always writes the split)
        return None
    validation = dsd["validation"]
    if len(validation) == 0:
        raise ConfigError(EMPTY)
    return Validation(model, tokenizer, validation, cfg, device, every, total_steps, best_dir)


def finish(model, recorder):
    """After a backend's training: early stopping's line, and with ``train.load_best_model_at_end`` the best
    point's weights loaded into ``model`` and said (``recorder.best``: ``{"step", "metric", "value"}`` of that
    point; None otherwise). Returns ``(model, recorder)``, as the backend did."""
    v = recorder.validation
    if recorder.stopped_early:
        distributed.print_main(f"train: {recorder.stopped_early}")
    best = v.load_best(model, recorder.evals) if v is not None else None
    if best is not None:
        metric = v.cfg.train.metric_for_best_model
        recorder.best = {"step": best["step"], "metric": metric, "value": best[metric]}
        distributed.print_main(f"train: models/ gets the weights of optimizer step {best['step']}, the best "
                               f"validation point ({metric} {best[metric]:.6g}; train.load_best_model_at_end)")
    return model, recorder


def estimate_line(model, tokenizer, dsd, cfg: Config, est: dict) -> str | None:
    """``onegpu estimate``'s line on what a validation pass adds (None: ``train.eval_strategy: no`` or no
    validation rows): the model's params and optimizer states stay (the gradients are freed after each
    optimizer step, before the pass), the pass adds its output layer's and loss's peak for batches of
    ``evaluate.per_device_eval_batch_size`` rows as long as the split's longest
    (:func:`onegpu.training.memory.autobatch.validation_term`; before prepare has run, the longest of the sampled
    rows, which the split is cut from). ``est``: :func:`onegpu.training.memory.autobatch.estimate`'s."""
    from onegpu.formatting import mib
    from onegpu.training.memory import autobatch
    from onegpu.training.objectives import collator_for, model_inputs
    split = dsd["validation"] if "validation" in dsd else dsd["train"]  # (prepare not run: the source's sample)
    if cfg.train.eval_strategy == "no" or len(split) == 0:
        return None
    task, rows = cfg.model.task, min(cfg.evaluate.per_device_eval_batch_size, len(split))
    inputs = model_inputs(split, task)
    probe = collator_for(task, tokenizer)([inputs[autobatch.longest_rows(split, 1)[0]]])  # (split: its length)
    term = autobatch.validation_term(model, probe, rows)
    s = est["states"]
    total = s["mem_params_bytes"] + s["mem_optimizer_bytes"] + term
    return (f"validation (train.eval_strategy: {cfg.train.eval_strategy}): a pass over batches of {rows} rows up to "
            f"{int(probe['input_ids'].shape[-1])} tokens adds its logits and loss, {mib(term)}, to the params and "
            f"optimizer states (the gradients are freed after each step): {mib(total)}, plus one layer's "
            "temporaries at a time (not estimated; no activations are kept without autograd)")
