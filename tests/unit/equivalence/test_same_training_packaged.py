"""The same training on the packaged SmolLM2-135M-Instruct itself (slow): every knob at once in float64,
and the splits in float32 with AdamW (the list of knobs: test_same_training.py)."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tests.unit.equivalence import float64 as f64  # noqa: E402

_packaged = f64.packaged_run


@pytest.fixture(scope="module")
def whole_logits(tmp_path_factory):
    """The reference of this file's float64 proofs, trained once: 4 x 1 with the whole logits on the rows of
    ``answers``; kept on disk between its two users (its step-1 gradients are 1.1 GB of float64, which a worker
    should not hold while other tests run)."""
    path = tmp_path_factory.mktemp("whole-logits") / "run.pt"

    def get() -> f64.Run:
        if path.is_file():
            return f64.Run(*torch.load(path, weights_only=False))
        run = _packaged(4, 1, fused=False, kind="answers")
        torch.save((run.rows, run.grads), path)
        return run
    yield get
    path.unlink(missing_ok=True)


@pytest.mark.slow
@pytest.mark.big_memory
def test_on_the_packaged_chat_model_every_same_training_knob_is_exact_in_float64(whole_logits):
    """The whole logits at 4 x 1 against two runs with the knobs on, grouped two ways (a difference of any
    would show at 1e-12): 1 x 4 fused padding-free on the Accelerate loop with checkpointing; 2 x 2 fused on
    the Trainer with reentrant checkpointing of every other layer and eager attention. Both steps (loss,
    grad_norm) and every parameter's step-1 gradient within 1e-12. An effective batch of 4 rows, not the
    job's 8: the whole 30-layer model in float64 costs the suite time in proportion to its rows (this file's
    time: tests/README.md), and 4 rows already split into micro-batches of 1 and 2 (several micro-batches, a
    short row beside a long one in one micro-batch); the job's own 8 rows and splits are the float32 test's.
    The rows are answers of 1..9 words (3 to 9 targets a row, ``float64.answer_rows``), not the job's
    one-word answers: with the same number of targets in every row, a mean of each micro-batch's own mean
    would equal the exact loss and pass (test_same_training_knobs.py plants it).

    At the helper's learning rate (SGD 1e-3), so step 2 runs on weights that step 1 moved. (Until the
    proofs computed the model's RMSNorms in float64, float64.py's docstring, step 2 moved by 1e-8 on some
    machines: the norms' float32 rounding, once taken for the model's conditioning.)"""
    ref = whole_logits()
    for run in (_packaged(1, 4, backend="accelerate", padding_free=True, gradient_checkpointing=True, kind="answers"),
                _packaged(2, 2, attn="eager", gradient_checkpointing=True, kind="answers",
                          gradient_checkpointing_kwargs={"use_reentrant": True, "every_n_layers": 2})):
        f64.assert_same(run, ref, steps=2)


@pytest.mark.slow
@pytest.mark.big_memory
def test_on_the_packaged_chat_model_the_splits_are_equal_in_float32():
    """The issue's job in float32, the fused head on: step 1 within 1e-6 of 8 x 1 (loss and grad_norm; the
    float32 floor of the reduction order is 1e-7..3e-7 here) and every parameter's gradient within 3e-5
    (the floor depends on the threads summing: under xdist, one thread per worker, within 1e-5; run alone
    with 2 threads, a layer norm's weight 1.4e-5 apart; a wrong loss, as the float32 log-normaliser of
    TRL's chunked head was, moved gradients by 1e-4), and step 2, the first on weights AdamW moved, within 1e-5
    (bench/same_training.py prints every split on both backends over more steps; exactness is float64's proof
    above)."""
    adamw = {"dtype": torch.float32, "steps": 2, "optim": "adamw_torch", "learning_rate": 1e-4, "weight_decay": 0.0,
             "max_grad_norm": 1.0, "seed": 42}  # the job's params (bench/same_training.py), 2 of its 3 steps
    ref = _packaged(**adamw)
    for run in (_packaged(1, 8, backend="accelerate", **adamw), _packaged(2, 4, padding_free=True, **adamw)):
        d1 = f64.distance(f64.Run(run.rows[:1], run.grads), f64.Run(ref.rows[:1], ref.grads))
        assert max(d1["loss"], d1["grad_norm"]) <= 1e-6, d1
        assert d1["gradient"] <= 3e-5, d1
        assert max(f64.distance(run, ref)[k] for k in ("loss", "grad_norm")) <= 1e-5


@pytest.mark.slow
def test_the_packaged_chat_model_in_float64_rounds_nothing_to_float32():
    """With :func:`float64.float64_norms` a 1e-15 change of single weights moves the packaged model's loss
    by rounding only (< 1e-13 relative). Without it the RMSNorms round to float32 and these changes
    (measured on an Intel Xeon with AVX-512) each moved the loss by the same 2.1e-8: the float64 proofs'
    1e-12 would rest on where a machine's summation order happens to leave the float32 roundings."""
    from onegpu.training import objectives
    from onegpu.training.objectives.loss import causal_lm_loss
    model = f64.packaged_chat_model().to(torch.float64).eval()
    assert f64.float64_norms(model) == 61  # 2 per layer, 30 layers, and the final norm
    rows = objectives.model_inputs(f64.instruction_data("yes_no", 8)["train"], "causal-lm").select(range(4))
    batch = objectives.collator_for("causal-lm", f64.chat_tokenizer())(list(rows))  # a padded micro-batch of 4

    def loss() -> float:
        with torch.no_grad():
            out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
            return float(causal_lm_loss(out, batch["labels"]))
    base, noise = loss(), torch.Generator().manual_seed(5)
    params = dict(model.named_parameters())
    for name in ("model.layers.0.self_attn.k_proj.weight", "model.layers.0.mlp.gate_proj.weight"):
        p, kept = params[name], params[name].detach().clone()
        with torch.no_grad():
            p.mul_(1 + 1e-15 * torch.randn(p.shape, generator=noise, dtype=p.dtype))
        moved = abs(loss() - base) / base
        with torch.no_grad():
            p.copy_(kept)
        assert moved < 1e-13, (name, moved)


def _fsdp_rank(rank: int, port: int, out_dir: str) -> None:
    """Rank ``rank`` of 2: the packaged model sharded (FSDP2, the fused LM head, checkpointing), 2 x 1 x 2 in float64;
    writes its rows (and rank 0 every parameter's step-1 gradient, gathered whole) to ``rank<r>.pt``."""
    import os
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from onegpu.training.parallel import distributed
    distributed.TIMEOUT_S = 600  # a 135M-parameter float64 step takes tens of seconds on 2 cores
    run = _packaged(1, 2, backend="accelerate", num_processes=2, eval_strategy="no", oom_retry=False,
                    fsdp={"enabled": True}, kind="answers", gradient_checkpointing=True)
    torch.save((run.rows, run.grads if rank == 0 else {}), f"{out_dir}/rank{rank}.pt")


@pytest.mark.slow
@pytest.mark.big_memory
def test_on_the_packaged_chat_model_the_fused_head_sharded_over_two_processes_is_exact_in_float64(
        tmp_path, whole_logits):
    """train.fsdp with the fused LM head on the packaged SmolLM2-135M-Instruct: 2 gloo processes of 1 x 2 (each rank
    holds half of every weight; the root, whose head the fused path reads, keeps its gathered weights from forward
    to backward), with checkpointing, = 1 unsharded process with the whole logits at 4 x 1, per step in float64:
    loss and every parameter's step-1 gradient within 1e-12, the same rows on both ranks. The global grad_norm
    within 1e-11: it sums 135M squares, and each rank sums its own shards (another order); a float64 sum of n terms
    moves by about sqrt(n) x 1.1e-16 = 1.3e-12 with the order (the gradients it sums are within 1e-12 here)."""
    import torch.multiprocessing as mp

    from tests.unit.training.parallel.test_distributed import _free_port
    mp.spawn(_fsdp_rank, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)
    (rows, grads), (other, _) = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    assert rows == other and len(rows) == 2
    ref = whole_logits()
    d = f64.distance(f64.Run(rows, grads), ref)
    print(f"packaged, fused head sharded over 2: {d}")
    assert [r["targets"] for r in rows] == [r["targets"] for r in ref.rows]
    assert max(d["loss"], d["gradient"]) <= f64.REL and d["grad_norm"] <= 1e-11, d
