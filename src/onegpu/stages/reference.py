"""``onegpu reference``: DPO's reference model scores every prepared pair once -> data/reference/.

With ``model.task: preference`` and ``train.dpo.precompute_ref_log_probs`` (TRL's name), the model training
starts from scores the chosen and rejected answer of every training, validation and test pair
(:mod:`onegpu.training.objectives.precomputed`); train and evaluate read the scores instead of keeping a reference
model. DVC re-runs this stage only when the model, the prepared data or the params that decide the scores change,
so a sweep of the learning rate, beta or the batch split scores the pairs once. Otherwise it writes
data/reference/unused.json and loads nothing.
"""
from __future__ import annotations

from onegpu.config import Config
from onegpu.training.objectives import precomputed


def run(cfg: Config) -> dict:
    if not precomputed.wanted(cfg):
        print(f"reference: nothing to score ({precomputed.save_unused(cfg)}) -> {precomputed.UNUSED}")
        return {}
    from transformers.utils import logging as hf_logging

    from onegpu import paths
    from onegpu.measure import memory
    from onegpu.models import loader
    from onegpu.training import prepared
    from onegpu.training.objectives import lm_head
    hf_logging.disable_progress_bar()  # no "Loading weights" bar between the stage's lines
    dsd = prepared.load_processed()
    model_path = loader.resolve_model_path(cfg.model.name_or_path)
    tokenizer = loader.load_tokenizer(str(paths.TOKENIZER) if model_path is None else model_path, cfg.model.task)
    model = precomputed.initial_model(cfg, tokenizer)
    if cfg.train.fused_lm_head:  # refused here as train would refuse it, before any scoring
        lm_head.check(model, f"model.name_or_path {cfg.model.name_or_path or 'null (built from config)'}")
        lm_head.attach(model)  # the output layer in tiles, as training runs it (no whole logits)
    device = memory.default_device()
    scores, runtime = precomputed.score_splits(model.to(device), dsd, tokenizer, cfg)
    precomputed.save(scores, {s: precomputed.key(cfg, dsd[s]) for s in scores}, runtime, memory.device_name(device))
    pairs = sum(len(v) // 2 for v in scores.values())
    print(f"reference: the reference model scored {pairs} pairs "
          f"({', '.join(f'{s} {len(v) // 2}' for s, v in scores.items())}) in {runtime:.1f} s on "
          f"{memory.device_name(device)} -> {precomputed.FILE} (train.dpo.precompute_ref_log_probs: train and "
          "evaluate read them, no reference model kept)")
    return {"pairs": pairs, "runtime_s": runtime}
