"""Causal language modelling (``model.task: causal-lm``), plain text or instruction data: the items are
the target tokens (position t predicts token t + 1; completion-only and assistant-only masks as prepare
wrote them); the loss is summed over them (:func:`onegpu.training.objectives.loss.causal_lm_loss`, the fused LM head
where it is on), perplexity and mean token accuracy held out (:mod:`onegpu.training.objectives.heldout`)."""
from __future__ import annotations

from onegpu.training.objectives.base import Objective
from onegpu.training.objectives.batches import CausalLMCollator, PaddingFreeCollator, causal_lm_columns


class CausalLM(Objective):
    task = "causal-lm"
    # Target tokens of ``labels`` ``(rows, seq_len)`` (unshifted): ``labels[..., 1:] != -100``.
    items_fn, loss_fn = "count_targets", "causal_lm_loss"

    def model_inputs(self, dsd):
        """The class column dropped (the collator makes token labels, or the rows bring theirs)."""
        return causal_lm_columns(dsd)

    def collator(self, tokenizer, flattened: bool = False):
        """Padded per micro-batch (:class:`~onegpu.training.objectives.batches.CausalLMCollator`), or one flattened
        row (:class:`~onegpu.training.objectives.batches.PaddingFreeCollator`)."""
        return PaddingFreeCollator() if flattened else CausalLMCollator(tokenizer)

    def heldout_metrics(self, model, tokenizer, dataset, cfg, device: str, prefix: str) -> dict:
        from onegpu.training.objectives import heldout
        return heldout.causal_lm_metrics(model, tokenizer, dataset, cfg, device, prefix)

    def result_line(self, metrics: dict) -> str:
        m = metrics
        rouge = f", ROUGE-L {m['test_rouge_l']:.3f}" if "test_rouge_l" in m else ""
        return (f"loss {m['test_loss']:.4f} nats/token, perplexity {m['test_perplexity']:.1f} on "
                f"{m['test_tokens']} test tokens{rouge}")


OBJECTIVE = CausalLM()
