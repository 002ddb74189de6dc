"""Preference tuning (``model.task: preference``): DPO and its kin on preference pairs
(:mod:`onegpu.data.preference`), the loss and figures of :mod:`onegpu.training.objectives.dpo`, TRL's names.

The items are the pairs. A micro-batch is one forward of the policy over both answers of each pair
(:class:`~onegpu.training.objectives.dpo.PreferenceCollator`, padded or padding-free) and one of the reference model
over the same batch under ``torch.no_grad()`` in eval mode: a frozen copy of the model as built (before the
first step; its parameters never train), or for LoRA the model itself with the adapter disabled (the base).
:meth:`Preference.prepare_model` sets the reference up when the model is built
(:func:`onegpu.training.session.build_model`), keyed by the model, so both backends, validation and the
memory probes find it.
"""
from __future__ import annotations

import time
import weakref
from dataclasses import dataclass

from onegpu.training.objectives import dpo, lm_head, precomputed
from onegpu.training.objectives.base import Objective
from onegpu.training.objectives.dpo import PreferenceCollator

PAIR_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")
REF_COLUMNS = ("ref_chosen_logps", "ref_rejected_logps")  # train.dpo.precompute_ref_log_probs (TRL's names)


@dataclass
class Reference:
    """A policy's reference: ``model`` (a frozen copy; None: the policy with its LoRA adapter disabled, or
    ``precomputed``: the rows carry its log-probabilities) and ``dpo`` (``train.dpo``,
    :class:`onegpu.config.DPOConfig`); ``sums``: the current optimizer step's pairs and figures so far (a
    float64 tensor on the device, :meth:`Preference.step_figures` takes it)."""
    model: object
    dpo: object
    sums: object = None
    precomputed: bool = False
    source: str = ""  # what the reference is, in words (the run's tag REFERENCE_TAG)


REFERENCE_TAG = "onegpu.dpo_reference"  # the training run's tag: what its reference was and where its scores came from
# The policy's transformers model -> its Reference; weak, so a dropped policy frees its reference copy.
_REFERENCES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _unwrapped(model):
    """The model inside a DDP wrapper (or ``model`` itself)."""
    return getattr(model, "module", model)


def reference_of(model) -> Reference:
    """The :class:`Reference` :meth:`Preference.prepare_model` set for ``model`` (wrapped or not).

    Raises:
        RuntimeError: none was set (a model not built by ``session.build_model``).
    """
    ref = _REFERENCES.get(lm_head._inner(_unwrapped(model)))
    if ref is None:
        raise RuntimeError("this model has no DPO reference: build it with onegpu.training.session.build_model")
    return ref


def _sequences(inputs: dict) -> int:
    """Sequences in a collated micro-batch (2 per pair); one host sync for a flattened row."""
    if inputs.get("attention_mask") is None and inputs.get("position_ids") is not None:
        return int(inputs["position_ids"].eq(0).sum())
    return int(inputs["input_ids"].shape[0])


class Preference(Objective):
    task = "preference"
    own_forward = True
    sequences_per_item = 2

    def dropout(self, cfg):
        """0 under ``train.dpo.disable_dropout`` (TRL's default: the policy's log-probabilities are then the
        reference's at step 1), else ``model.dropout``."""
        return 0.0 if cfg.train.dpo.disable_dropout else cfg.model.dropout

    def count_items(self, labels):
        """Pairs of a padded micro-batch's ``labels`` ``(2 pairs, seq_len)``: a 0-dim int64 tensor."""
        import torch
        return torch.tensor(labels.shape[0] // 2, device=labels.device)

    def count_batch(self, inputs: dict):
        """Pairs of a collated micro-batch, padded or flattened: a 0-dim int64 tensor on its device."""
        import torch
        if inputs.get("attention_mask") is None and inputs.get("position_ids") is not None:
            return inputs["position_ids"].eq(0).sum() // 2
        return torch.tensor(inputs["input_ids"].shape[0] // 2, device=inputs["input_ids"].device)

    def loss(self, outputs, labels, num_items_in_batch=None):
        """The policy's half alone, for the memory probes (what a forward and backward save and peak at; the
        reference runs without autograd): minus the rows' summed answer log-probabilities over the pairs.
        Training's loss is :meth:`step_loss`."""
        seq = dpo.sequence_ids({"input_ids": labels})
        logps, _ = dpo.sequence_logps(outputs, labels, seq, labels.shape[0])
        return -logps.sum() / (num_items_in_batch if num_items_in_batch is not None else max(labels.shape[0] // 2, 1))

    def step_loss(self, model, inputs: dict, num_items):
        """One micro-batch's share of the step's loss (:func:`onegpu.training.objectives.dpo.step_share`): the policy's
        forward with autograd, the reference's without, the per-pair losses of ``train.dpo``."""
        features = {k: v for k, v in inputs.items() if k not in ("labels", "ref_logps")}
        labels, seq, n = inputs["labels"], dpo.sequence_ids(inputs), _sequences(inputs)
        import torch
        policy, tokens = dpo.sequence_logps(model(**features), labels, seq, n)
        ref = reference_of(model)
        reference = (inputs["ref_logps"].to(policy.dtype) if "ref_logps" in inputs
                     else self.reference_logps(model, features, labels, seq, n))
        figures = dpo.figures(policy, reference, ref.dpo.beta)
        row = torch.stack([figures[k].double() for k in dpo.FIGURES] + [policy.new_tensor(n // 2).double()])
        ref.sums = row if ref.sums is None else ref.sums + row  # the step's figures, no host sync
        return dpo.step_share(dpo.pair_losses(policy, reference, tokens, ref.dpo), num_items)

    def memory_terms(self, model) -> dict[str, int]:
        """``mem_reference_bytes``: the frozen copy's parameters and buffers, beside the policy's; 0 for LoRA
        (the reference is the policy's own base weights)."""
        from onegpu.measure import memory
        ref = reference_of(model).model
        return {"mem_reference_bytes": 0 if ref is None else
                memory.tensors_bytes(list(ref.parameters()) + list(ref.buffers()))}

    def estimate_line(self, model) -> str:
        from onegpu.formatting import mib
        ref = self.memory_terms(model)["mem_reference_bytes"]
        if reference_of(model).precomputed:
            return ("the reference model: 0 MiB (train.dpo.precompute_ref_log_probs: its log-probabilities computed "
                    "once before step 1, one pass over the pairs without autograd)")
        if not ref:
            return ("the reference model: 0 MiB (LoRA: the policy's base under the disabled adapter, an extra "
                    "forward without autograd per micro-batch)")
        return (f"the reference model: {mib(ref)} more, a frozen copy beside the policy (not in the totals above), "
                "and an extra forward without autograd per micro-batch")

    def step_figures(self, model):
        """A callable that returns the optimizer step's figures (:data:`onegpu.training.objectives.dpo.FIGURES`, TRL's
        names) as means over the step's pairs, all micro-batches and all processes (an all-reduce of sums:
        no padded duplicate counted), and starts the next step's; one host sync."""
        ref = reference_of(model)

        def take() -> dict:
            from onegpu.training.parallel import distributed
            sums, ref.sums = ref.sums, None
            if sums is None:
                return {}
            *values, pairs = distributed.sum_over_ranks(sums).tolist()
            return {k: v / pairs for k, v in zip(dpo.FIGURES, values)}
        return take

    def restart_step(self, model) -> None:
        reference_of(model).sums = None

    def shard(self, model, shard_fn) -> None:
        """The frozen reference copy sharded as the policy is (``train.fsdp``: each process keeps 1/N of it, its
        forward gathers the weights with every process, one per micro-batch as the policy's); LoRA's reference is
        the sharded policy itself, a precomputed one no model."""
        ref = reference_of(model)
        if ref.model is not None:
            shard_fn(ref.model)

    def pad_loss(self, model, inputs: dict):
        """:meth:`step_loss` times 0, the step's figures as they were (a micro-batch of repeated pairs)."""
        ref = reference_of(model)
        kept = ref.sums
        loss = self.step_loss(model, inputs, 1) * 0
        ref.sums = kept
        return loss

    def reference_logps(self, model, features: dict, labels, seq, n: int):
        """The reference's sequence log-probabilities ``(n,)`` for the batch (no autograd, eval mode). A sharded
        frozen copy (``train.fsdp``) gives its gathered weights back after the scores
        (:func:`onegpu.training.parallel.sharding.release`: it runs no backward that would)."""
        import torch

        from onegpu.training.parallel import sharding
        ref, inner = reference_of(model), _unwrapped(model)
        if ref.precomputed:
            raise RuntimeError("train.dpo.precompute_ref_log_probs: these rows carry no reference log-probabilities")
        with torch.no_grad():
            if ref.model is not None:
                device = features["input_ids"].device
                if next(ref.model.parameters()).device != device:
                    ref.model.to(device)  # once: where the policy went
                try:
                    return dpo.sequence_logps(dpo.scoring_output(ref.model, features), labels, seq, n)[0]
                finally:
                    sharding.release(ref.model)
            was = inner.training
            inner.eval()
            try:
                with inner.disable_adapter():
                    return dpo.sequence_logps(dpo.scoring_output(inner, features), labels, seq, n)[0]
            finally:
                inner.train(was)

    def prepare_model(self, model, cfg) -> None:
        """Set ``model``'s reference: a frozen copy (eval mode, no gradient), or for LoRA the base under the
        disabled adapter (the model itself: nothing copied)."""
        import copy
        frozen, precomputed = None, cfg.train.dpo.precompute_ref_log_probs
        if cfg.model.lora_adapters is None and not precomputed:
            frozen = copy.deepcopy(model).eval().requires_grad_(False)
        source = ("precomputed (train.dpo.precompute_ref_log_probs)" if precomputed else
                  "the policy's base, its LoRA adapter disabled" if frozen is None else
                  "a frozen copy of the model as built (eval mode, no gradient)")
        _REFERENCES[lm_head._inner(model)] = Reference(frozen, cfg.train.dpo, precomputed=precomputed, source=source)

    def run_tags(self, model) -> dict[str, str]:
        """:data:`REFERENCE_TAG`: the reference in words; a precomputed one says where its scores came from
        (the reference stage's file at its DVC version, or scored before step 1, and why)."""
        return {REFERENCE_TAG: reference_of(model).source}

    def prepared_data(self, dsd, model, tokenizer, cfg):
        """``dsd`` with the reference's log-probabilities of every training and validation pair as columns
        (:data:`REF_COLUMNS`, float64) under ``train.dpo.precompute_ref_log_probs``: the reference stage's
        (data/reference/, :mod:`onegpu.training.objectives.precomputed`) where they were scored for these pairs and
        params, else scored here by ``model`` as built (it is the reference before the first step: a LoRA
        adapter's first state adds nothing), in eval mode without autograd; without the flag ``dsd``."""
        if not cfg.train.dpo.precompute_ref_log_probs:
            return dsd
        from datasets import DatasetDict

        from onegpu.training.parallel import distributed
        start, was, dsd, whence = time.perf_counter(), model.training, DatasetDict(dict(dsd)), []
        model.eval()
        try:
            for s in [s for s in ("train", "validation") if s in dsd]:
                logps, why = precomputed.load(s, dsd[s], cfg)
                if logps is None:
                    logps = precomputed.score(model, dsd[s], tokenizer, cfg)
                    why = f"scored before step 1 ({why})"
                whence.append(why)
                dsd[s] = dsd[s].add_column(REF_COLUMNS[0], logps[0::2]).add_column(REF_COLUMNS[1], logps[1::2])
        finally:
            model.train(was)
        reference_of(model).source = f"precomputed: {'; '.join(dict.fromkeys(whence))}"
        distributed.print_main(f"train: the reference's log-probabilities of {len(dsd['train'])} training pairs "
                               f"{'; '.join(dict.fromkeys(whence))} ({time.perf_counter() - start:.1f} s here; "
                               "train.dpo.precompute_ref_log_probs: no reference model kept)")
        return dsd

    def model_inputs(self, dsd):
        """The pairs' token columns (``prompt_ids``, ``chosen_ids``, ``rejected_ids``) and any precomputed
        reference log-probabilities (:data:`REF_COLUMNS`) alone."""
        cols = dsd.column_names if hasattr(dsd, "features") else dsd["train"].column_names
        return dsd.remove_columns([c for c in cols if c not in PAIR_COLUMNS + REF_COLUMNS])

    def collator(self, tokenizer, flattened: bool = False):
        return PreferenceCollator(tokenizer.pad_token_id, flattened)

    def heldout_metrics(self, model, tokenizer, dataset, cfg, device: str, prefix: str) -> dict:
        """The split's DPO loss (a mean over its pairs), TRL's figures (:data:`onegpu.training.objectives.dpo.FIGURES`,
        means over the pairs), ``reference_accuracy`` (the reference's own pairwise accuracy: the share of pairs
        whose chosen answer it finds likelier, the baseline a trained policy must beat), ``pairs``, ``runtime``
        (s) and ``samples_per_second`` (pairs), each under ``prefix``; exact over the split (sums in float64,
        all-reduced over the processes, each reading its share)."""
        import torch

        from onegpu.training.objectives import heldout
        from onegpu.training.parallel import distributed
        ref = reference_of(model)
        model.to(device).eval()
        sums = torch.zeros(3 + len(dpo.FIGURES), dtype=torch.float64, device=device)  # loss, pairs, ref., figures
        start = time.perf_counter()
        with torch.no_grad():
            for batch in heldout.batches(self.model_inputs(dataset), cfg, self.collator(tokenizer)):
                batch = {k: v.to(device) for k, v in batch.items()}
                labels, stored = batch.pop("labels"), batch.pop("ref_logps", None)
                seq, n = dpo.sequence_ids(batch), _sequences(batch)
                policy, tokens = dpo.sequence_logps(dpo.scoring_output(model, batch), labels, seq, n)
                reference = (stored.to(policy.dtype) if stored is not None
                             else self.reference_logps(model, batch, labels, seq, n))
                figures = dpo.figures(policy, reference, ref.dpo.beta)
                sums += torch.stack([dpo.pair_losses(policy, reference, tokens, ref.dpo).sum().double(),
                                     torch.tensor(n // 2, device=device, dtype=torch.float64),
                                     reference[0::2].gt(reference[1::2]).sum().double(),
                                     *(figures[k].double() for k in dpo.FIGURES)])
        total, pairs, ref_hits, *figures = distributed.sum_over_ranks(sums).tolist()
        runtime = time.perf_counter() - start
        out = {"loss": total / pairs, **{k: v / pairs for k, v in zip(dpo.FIGURES, figures)},
               "reference_accuracy": ref_hits / pairs, "pairs": int(pairs), "runtime": runtime,
               "samples_per_second": pairs / runtime}
        return {f"{prefix}_{k}": v for k, v in out.items()}

    def test_figures(self, model, tokenizer, dataset, cfg, device: str) -> tuple[dict, list[int], list[int]]:
        """:meth:`heldout_metrics` of the trained ``model`` (loaded from models/) against the reference training
        started from: its scores from the reference stage under ``train.dpo.precompute_ref_log_probs`` where
        they were scored for these pairs and params (:func:`onegpu.training.objectives.precomputed.load`), else the
        model itself, rebuilt (:func:`onegpu.training.objectives.precomputed.initial_model`)."""
        from onegpu.training.objectives import heldout
        logps = precomputed.load("test", dataset, cfg)[0] if precomputed.wanted(cfg) else None
        if logps is None:
            reference = Reference(precomputed.initial_model(cfg, tokenizer), cfg.train.dpo)
        else:
            reference = Reference(None, cfg.train.dpo, precomputed=True)
            dataset = dataset.add_column(REF_COLUMNS[0], logps[0::2]).add_column(REF_COLUMNS[1], logps[1::2])
        _REFERENCES[lm_head._inner(_unwrapped(model))] = reference
        return self.heldout_metrics(model, tokenizer, dataset, cfg, device, heldout.TEST), [], []

    def result_line(self, metrics: dict) -> str:
        m = metrics
        return (f"DPO loss {m['test_loss']:.4f}, reward accuracy {m['test_rewards/accuracies']:.3f} against the "
                f"reference's own {m['test_reference_accuracy']:.3f} (pairs whose chosen answer it finds likelier), "
                f"margin {m['test_rewards/margins']:.4f} on {m['test_pairs']} test pairs")


OBJECTIVE = Preference()
