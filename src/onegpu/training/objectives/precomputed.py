"""DPO's reference log-probabilities scored once (``train.dpo.precompute_ref_log_probs``, TRL's name): the
``reference`` stage (``onegpu reference``, :mod:`onegpu.stages.reference`) scores every pair of every split
with the model training starts from and writes data/reference/; the train and evaluate stages read the
log-probabilities from there instead of keeping a reference model.

data/reference/logps.safetensors holds one float64 tensor per split, ``(2 * pairs,)``: each pair's chosen then
rejected sequence log-probability, in the split's row order; its metadata ``<split>`` holds :func:`key` of the
split's pairs and the params that decide the scores (:data:`PARAMS`), ``runtime_s`` and ``device``. DVC
re-runs the stage only when the model, the prepared data or one of those params changes, and its run cache
brings back a scoring it has kept. A stage with nothing to score (another task, the flag off) writes
data/reference/unused.json instead, so DVC has its output.
"""
from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

from onegpu import paths
from onegpu.config import Config, flatten, has_reference

FILE = paths.REFERENCE / "logps.safetensors"
UNUSED = paths.REFERENCE / "unused.json"
# What decides the reference's scores besides the pairs themselves (dvc.yaml's params of the stage: a test
# keeps the two the same): the model as built, its output layer, the batches it scores in.
PARAMS = ("model.task", "model.name_or_path", "model.n_layer", "model.n_embd", "model.n_head",
          "model.attn_implementation", "data.max_length", "train.seed", "train.fused_lm_head",
          "train.dpo.precompute_ref_log_probs", "evaluate.per_device_eval_batch_size")


def wanted(cfg: Config) -> bool:
    """Whether this run's objective has a reference model and asks for its log-probabilities precomputed."""
    return has_reference(cfg.model.task) and cfg.train.dpo.precompute_ref_log_probs


def key(cfg: Config, rows) -> str:
    """A SHA-256 hex digest of ``rows``' token columns (``prompt_ids``, ``chosen_ids``, ``rejected_ids``, in
    order) and ``cfg``'s :data:`PARAMS`: equal digests, equal scores."""
    h = hashlib.sha256()
    values = flatten(cfg.to_dict())
    h.update(json.dumps({k: values.get(k) for k in PARAMS}, sort_keys=True).encode())
    for col in ("prompt_ids", "chosen_ids", "rejected_ids"):
        for ids in rows[col]:
            h.update(json.dumps(ids).encode())
    return h.hexdigest()


def initial_model(cfg: Config, tokenizer):
    """The model training starts from, frozen (eval mode, no gradient): ``model.name_or_path`` loaded, or built
    from config, with ``train.seed`` as the train stage builds it (for LoRA the base, which is what a fresh
    adapter computes: its second matrix is zero; the model's own dropout settings, inert in eval mode and
    drawing nothing at build). The reference model of the reference and evaluate stages."""
    from transformers import set_seed

    from onegpu.models import loader
    set_seed(cfg.train.seed)
    model = loader.build_causal_lm(loader.resolve_model_path(cfg.model.name_or_path), tokenizer, cfg.model,
                                   cfg.data.max_length, None, cfg.model.attn_implementation)
    return model.eval().requires_grad_(False)


def score(model, rows, tokenizer, cfg: Config) -> list[float]:
    """``model``'s sequence log-probabilities of every pair of ``rows`` (chosen, rejected alternating: a list
    of ``2 * len(rows)`` floats), in its current mode, without autograd, in batches of
    ``evaluate.per_device_eval_batch_size`` pairs; each process scores all of them. Through the fused LM
    head's tiles where it is attached (:mod:`onegpu.training.objectives.lm_head`), else the whole logits."""
    import torch
    from torch.utils.data import DataLoader

    from onegpu.training.objectives import dpo
    device, out = next(model.parameters()).device, []
    pairs = rows.select_columns(["prompt_ids", "chosen_ids", "rejected_ids"])
    # A DataLoader of its own, not training.objectives.heldout.batches: heldout imports the objectives, whose params
    # (all of train.dpo, model.lora) would then re-run this stage in dvc.yaml (tests/unit/test_dvc_yaml.py).
    for batch in DataLoader(pairs, batch_size=cfg.evaluate.per_device_eval_batch_size,
                            collate_fn=dpo.PreferenceCollator(tokenizer.pad_token_id)):
        batch = {k: v.to(device) for k, v in batch.items()}
        labels = batch.pop("labels")
        with torch.no_grad():
            seq, n = dpo.sequence_ids(batch), int(batch["input_ids"].shape[0])
            out += dpo.sequence_logps(dpo.scoring_output(model, batch), labels, seq, n)[0].tolist()
    return out


def save(scores: dict[str, list[float]], keys: dict[str, str], runtime_s: float, device: str) -> None:
    """data/reference/ as one folder, atomically: logps.safetensors (``scores`` per split, float64, metadata
    ``keys`` per split, ``runtime_s`` (s), ``device``)."""
    import torch
    from safetensors.torch import save_file
    with paths.atomic_dir(paths.REFERENCE) as tmp:
        save_file({s: torch.tensor(v, dtype=torch.float64) for s, v in scores.items()},
                  str(Path(tmp) / FILE.name), metadata={**keys, "runtime_s": f"{runtime_s:.3f}", "device": device})


def save_unused(cfg: Config) -> str:
    """data/reference/unused.json alone: why nothing was scored (the same bytes whatever else the params say);
    returns the why."""
    why = ("train.dpo.precompute_ref_log_probs is false" if has_reference(cfg.model.task)
           else f"model.task {cfg.model.task} has no reference model")
    with paths.atomic_dir(paths.REFERENCE) as tmp:
        (Path(tmp) / UNUSED.name).write_text(json.dumps({"scored": False, "why": why}) + "\n")
    return why


def load(split: str, rows, cfg: Config) -> tuple[list[float] | None, str]:
    """The stored scores of ``split`` when data/reference/ holds them for exactly ``rows`` under ``cfg``
    (:func:`key`), with where they came from in words; else ``(None, why not)``."""
    if not FILE.is_file():
        return None, f"{paths.REFERENCE} holds no scores (the reference stage: dvc repro)"
    from safetensors import safe_open
    with safe_open(str(FILE), framework="pt") as f:
        meta = f.metadata() or {}
        if meta.get(split) != key(cfg, rows):
            return None, f"{FILE} was scored for other pairs or params (the reference stage re-runs: dvc repro)"
        version = paths.dvc_version(paths.REFERENCE)  # data/reference@<md5>.dir once DVC recorded it
        return f.get_tensor(split).tolist(), (f"read from {FILE}" + (f" ({version})" if "@" in version else "")
                                              + f", scored by the reference stage in "
                                              f"{float(meta['runtime_s']):.1f} s on {meta['device']}")


def score_splits(model, dsd, tokenizer, cfg: Config) -> tuple[dict[str, list[float]], float]:
    """:func:`score` of every split of ``dsd``, and the seconds it took (wall clock)."""
    start = time.perf_counter()
    scores = {s: score(model, dsd[s], tokenizer, cfg) for s in dsd}
    return scores, time.perf_counter() - start
