"""Every knob that onegpu calls the same training (out of the equivalence key, :data:`NOT_IN_EQUIVALENCE_KEY`)
is proven against its reference in float64, where rounding (~1e-16) hides nothing: per optimizer step the
loss and grad_norm, and every parameter's gradient of step 1, within 1e-12 relative
(tests/unit/equivalence/float64.py).

Jobs: a causal LM of SmolLM2-135M-Instruct's shape built from config (width, heads, vocabulary 49,152, tied
head; 2 of its 30 layers) on the issue's job (prompts of 3-30 words, answers "yes"/"no", completion-only
loss: the fused head), and on answers of 1..9 words and multi-turn assistant-only chats; the packaged
SmolLM2-135M-Instruct itself (slow); the packaged all-MiniLM-L6-v2 classifier (the default job). The splits
are proven where the micro-batches of a split hold different numbers of targets (answers of 3 to 9 target
tokens; the classifier's short second step of 6 rows): on the issue's job, 3 targets in every row, a loss
that averaged each micro-batch's own mean would equal the exact one. The knobs and classifier files plant
that loss and show their proof fails (``test_the_splits_proof_sees_a_mean_of_micro_batch_means``). Every knob of
the key's list is classified in :data:`PROOFS`: proven (the test that does), or why it needs no float64 proof.

The proofs are four files, one per job, so that the suite's workers share them: this one (the list, the
fused head on the from-config model), ``test_same_training_knobs.py`` (the other knobs on the from-config
model), ``test_same_training_classifier.py`` and ``test_same_training_packaged.py``.
"""
from __future__ import annotations

import functools
import importlib
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from onegpu.equivalence.key import NOT_IN_EQUIVALENCE_KEY  # noqa: E402
from tests.unit.equivalence import float64 as f64  # noqa: E402

PROOF_MODULES = ("test_same_training", "test_same_training_knobs", "test_same_training_classifier",
                 "test_same_training_packaged", "test_same_training_preference")

# Each knob out of the equivalence key: how it is proven the same training.
PROOFS = {
    "train.per_device_train_batch_size": "float64: test_splits_*",
    "train.gradient_accumulation_steps": "float64: test_splits_*",
    "train.effective_batch_size": "float64: test_splits_* (the resolved effective batch is in the key)",
    "train.num_processes": "float64: test_two_processes_are_one_in_float64_and_the_host_allocator_*",
    "train.memory_budget_gib": "float64: test_splits_* (auto picks a split; "
                               "tests/unit/training/memory/test_autobatch.py: the split given by hand's key)",
    "train.gradient_checkpointing": "float64: test_checkpointing_*",
    "train.gradient_checkpointing_kwargs.use_reentrant": "float64: test_checkpointing_*",
    "train.gradient_checkpointing_kwargs.every_n_layers": "float64: test_checkpointing_*",
    "train.gradient_checkpointing_blocks": "float64: test_checkpointing_granularities_of_the_classifier",
    "train.backend": "float64: test_both_backends_*",
    "train.oom_retry": "float64: test_an_out_of_memory_retry_is_the_same_training",
    "data.padding_free": "float64: test_padding_free_*",
    "model.attn_implementation": "float64: test_the_attention_kernel_of_the_classifier_* (BERT: eager = SDPA); "
                                 "test_the_attention_kernel_eager_is_sdpa_in_float64 (Llama, its eager "
                                 "softmax in float64); flash_attention_2 is CUDA only",
    "train.fused_lm_head": "float64: test_the_fused_head_* (under train.fsdp: test_distributed.py's fused-* cases)",
    "train.dpo.precompute_ref_log_probs": "float64: test_a_precomputed_reference_*",
    "train.cpu_allocator": "float64: test_two_processes_are_one_in_float64_and_the_host_allocator_* (each rank "
                           "under glibc's defaults, the reference under the caching allocator)",
    "train.dataloader_num_workers": "float64: test_dataloader_workers_are_the_same_training",
    # FSDP2 over 2 gloo processes = 1 process unsharded, float64 within 1e-12: its proof runs in the two spawned
    # ranks that tests/unit/training/parallel/test_distributed.py's other multi-process tests share (spawns are
    # costly).
    "train.fsdp.enabled": "float64 in 2 ranks: tests/unit/training/parallel/test_distributed.py::"
                          "test_fsdp2_over_two_processes_is_one_process_in_float64 (accumulation 1 and 4, whole "
                          "logits and the fused LM head)",
    "train.fsdp.reshard_after_forward": "float64 in 2 ranks: tests/unit/training/parallel/test_distributed.py::"
                                        "test_fsdp2_over_two_processes_is_one_process_in_float64 (true at "
                                        "accumulation 1, false at 4)",
    # More than one machine: two launchers on loopback (machine ranks 0 and 1, one process each) = one machine of
    # two processes, float64 within 1e-12 (torchrun's static rendezvous; an integration test: two launches).
    "train.num_machines": "float64 over 2 launchers: tests/integration/test_data_parallel_machines.py::"
                          "test_two_machines_of_one_process_train_as_one_machine_of_two_in_float64",
    "train.machine_rank": "which ranks a machine holds: the same test (machine ranks 0 and 1)",
    "train.main_process_ip": "where the processes meet: no arithmetic (the same test meets at 127.0.0.1)",
    "train.main_process_port": "where the processes meet: no arithmetic",
    # Validation during training: bit-equal with it off (stronger than float64), both backends, dropout on.
    "train.eval_strategy": "bit-equal: tests/unit/training/test_validation.py (validation on vs off)",
    "train.eval_steps": "bit-equal: tests/unit/training/test_validation.py (validation on vs off)",
    "train.load_best_model_at_end": "which validated step's weights models/ gets; the steps trained are bit-equal "
                                    "(tests/unit/training/test_validation.py)",
    "train.early_stopping_patience": "where the run stops; the steps before are bit-equal "
                                     "(tests/unit/training/test_validation.py)",
    "train.metric_for_best_model": "which validation point is the best: no arithmetic",
    "train.greater_is_better": "which validation point is the best: no arithmetic",
    "train.early_stopping_threshold": "which validation point is the best: no arithmetic",
    # No float64 proof possible or needed, and why:
    "train.logging_steps": "terminal output only: no arithmetic",
    "train.save_steps": "checkpoints: tests/unit/training/lifecycle/test_resume.py "
                        "(resumed = uninterrupted, per step)",
    "evaluate.per_device_eval_batch_size": "evaluation only: no training arithmetic",
    "tracking.experiment_name": "where results are logged: no arithmetic",
    "data.max_eval_samples": "evaluation data only",
    "evaluate.max_new_tokens": "evaluation only",
    "train.tf32": "TF32 is another precision (CUDA only): compared within its own tolerance, not 'the same'",
    "train.torch_compile": "fused kernels (other summation order): compared within the precision's tolerance",
    "train.torch_compile_mode": "how torch.compile tunes its kernels: as train.torch_compile",
    "train.dataloader_pin_memory": "CUDA only (host batches page-locked): float32 on a GPU, tests/gpu",
    "train.torch_empty_cache_steps": "CUDA only (the caching allocator): float32 on a GPU, tests/gpu",
    "train.activation_offloading": "CUDA only (refused on a CPU): float32 against the float32 floor, tests/gpu",
}


def test_every_knob_out_of_the_key_says_how_it_is_proven():
    assert sorted(PROOFS) == sorted(NOT_IN_EQUIVALENCE_KEY)
    tests = {name for m in PROOF_MODULES for name in vars(importlib.import_module(f"tests.unit.equivalence.{m}"))
             if name.startswith("test_")}
    for key, how in PROOFS.items():
        if how.startswith("float64: "):
            named = how.removeprefix("float64: ").split()[0]
            assert any(t.startswith(named.rstrip("*")) for t in tests), (key, named)
        if "::test_" in how:  # a proof in another test file: that file has the test
            path, _, name = how.split(": ", 1)[1].split()[0].partition("::")
            assert f"def {name}(" in (Path(__file__).parents[3] / path).read_text(), (key, how)


# -- a causal LM of SmolLM2's shape, built from config: the fused head --

def _ref(**kw) -> f64.Run:
    """A reference run, kept for the file's tests of the current shape: ``f64.lm_run(**kw)``. Every knob's
    reference is the fused head at 8 x 1 (it projects only the targets: several times faster), which equals the
    whole logits (test_same_training.py::test_the_fused_head_is_the_whole_logits_in_float64)."""
    return _ref_of(f64.current_shape(), **kw)


@functools.cache
def _ref_of(shape: str, **kw) -> f64.Run:
    return f64.lm_run(**kw)


@pytest.mark.usefixtures("from_config_shape")  # the narrow twin (make test), SmolLM2's width (make test-all)
def test_the_fused_head_is_the_whole_logits_in_float64():
    """The issue's job (answers of one token; TRL's kernel, a float32 log-sum-exp, was 1e-5..2e-4 off)."""
    f64.assert_same(_ref(), _ref(fused=False))


@pytest.mark.usefixtures("from_config_shape")  # the narrow twin (make test), SmolLM2's width (make test-all)
@pytest.mark.parametrize("kind", ["answers", "chat"])
def test_the_fused_head_is_the_whole_logits_on_long_answers_and_assistant_only_chats(kind):
    f64.assert_same(f64.lm_run(kind, 2, 4), f64.lm_run(kind, 2, 4, fused=False))


@pytest.mark.usefixtures("from_config_shape")  # the narrow twin (make test), SmolLM2's width (make test-all)
@pytest.mark.parametrize("variant", ["untied", "lora"])
def test_the_fused_head_is_the_whole_logits_with_an_untied_head_and_under_lora(variant):
    kw = {"tied": False} if variant == "untied" else {"lora": True}
    f64.assert_same(f64.lm_run(micro=2, accum=4, **kw), f64.lm_run(micro=2, accum=4, fused=False, **kw))


def test_the_float64_copies_are_transformers_own_formulas_in_float32():
    """float64.py runs copies of Llama's RMSNorm and eager attention with float64 in place of float32; in
    float32, where that change is a no-op, each copy equals transformers' own to the bit (a transformers
    release that changes either formula fails here, not silently in the proofs)."""
    from transformers.models.llama import modeling_llama
    torch.manual_seed(0)
    norm = modeling_llama.LlamaRMSNorm(8)
    torch.nn.init.normal_(norm.weight)
    x = torch.randn(2, 5, 8)
    assert torch.equal(norm(x), f64._rms_norm_float64(norm, x))
    module = torch.nn.Module()
    module.num_key_value_groups = 3
    module.eval()
    q, k, v = torch.randn(1, 6, 5, 4), torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)
    mask = torch.zeros(1, 1, 5, 5).masked_fill(torch.ones(5, 5).triu(1).bool(), torch.finfo(torch.float32).min)
    own = modeling_llama.eager_attention_forward(module, q, k, v, mask, scaling=0.3)
    ours = f64._eager_attention_float64(module, q, k, v, mask, scaling=0.3)
    assert all(torch.equal(a, b) for a, b in zip(own, ours))
