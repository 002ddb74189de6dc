"""The two training backends (``trainer``, ``accelerate``) on a tiny BERT classifier built from config.

They must take the same optimizer steps on the same data in the same order and give the same per-step
losses and gradient norms, and the loss must be exact under gradient accumulation (one micro-batch of 8 =
two of 4 = four of 2). The data has texts of different lengths, so padding differs between micro-batches.
"""
from __future__ import annotations

import functools
import warnings

import pytest

torch = pytest.importorskip("torch")

from onegpu.config import from_container  # noqa: E402
from onegpu.training.backends.base import TrainRequest  # noqa: E402
from tests.unit.tiny import LOSS_TOL, NORM_TOL, dataset, interrupt_at_step_2, tiny_bert, tokenizer  # noqa: E402


@functools.cache
def run(backend: str, micro: int, accum: int, n: int = 24, max_steps: int = 3, epochs: float = 1.0,
        optim: str = "adamw_torch", lr: float = 1e-3, warmup: float = 0.0, max_grad_norm: float = 1.0,
        checkpointing: bool = False, attn: str | None = None,
        extra: tuple = (), intermediate: int = 64, compiled: bool = True) -> tuple[list[dict], list[str], bool, dict]:
    """Train a fresh, identically seeded tiny BERT (attention kernel ``attn``; feed-forward width
    ``intermediate``; ``extra``: more ``(train key, value)`` pairs); ``compiled`` False runs every
    ``torch.compile`` call eagerly (torch's ``force_eager`` stance: torchao's low-bit AdamW step).

    Returns the StepRecorder rows, the warnings raised, whether the trained model has activation
    checkpointing on, and the recorder's memory breakdown (bytes).
    """
    import importlib
    cfg = from_container({
        "model": {"dropout": 0.0},
        "train": {"backend": backend, "per_device_train_batch_size": micro,
                  "gradient_accumulation_steps": accum, "max_steps": max_steps, "num_train_epochs": epochs,
                  "learning_rate": lr, "warmup_ratio": warmup, "weight_decay": 0.01, "optim": optim,
                  "max_grad_norm": max_grad_norm, "seed": 7, "gradient_checkpointing": checkpointing,
                  "logging_steps": 2, **dict(extra)},
    }, source="test")
    from onegpu.training.backends import base
    module = importlib.import_module(base.REGISTRY[backend])
    sunk = []
    with warnings.catch_warnings(record=True) as caught, torch.compiler.set_stance(
            "default" if compiled else "force_eager"):
        warnings.simplefilter("always")
        model, steps = module.train(base.TrainRequest(tiny_bert(attn, intermediate), tokenizer(), dataset(n), cfg,
                                                      sink=lambda m, s: sunk.append((s, m))))
    assert [s for s, _ in sunk] == [r["step"] for r in steps.rows]
    assert not hasattr(model, "module"), "the returned model must be unwrapped"
    return steps.rows, [str(w.message) for w in caught], model.is_activation_checkpointing, dict(steps.breakdown)


def col(rows, key):
    return [r[key] for r in rows]


def max_diff(a, b, key):
    assert len(a) == len(b), f"{len(a)} vs {len(b)} steps"
    return max(abs(x - y) for x, y in zip(col(a, key), col(b, key)))


# AdamW: no clipping (max_grad_norm 0 only measures the norm), warmup_ratio 0.34 of 3 steps = 2 warmup
# steps, lr 0, 5e-4, 1e-3. SGD: clipped at 0.1 (the grad norms here are 0.09-0.4), linear decay from 0.5.
@pytest.mark.parametrize("optim,lr,warmup,max_grad_norm,lrs", [
    ("adamw_torch", 1e-3, 0.34, 0.0, [0.0, 5e-4, 1e-3]),
    ("sgd", 0.5, 0.0, 0.1, [0.5, 1 / 3, 1 / 6]),
])
def test_trainer_and_accelerate_take_the_same_steps(optim, lr, warmup, max_grad_norm, lrs):
    kw = dict(optim=optim, lr=lr, warmup=warmup, max_grad_norm=max_grad_norm)
    hf, *_ = run("trainer", 4, 2, **kw)
    acc, *_ = run("accelerate", 4, 2, **kw)
    assert col(hf, "step") == col(acc, "step") == [1, 2, 3]
    assert col(hf, "tokens") == col(acc, "tokens")  # the same examples in the same order
    assert max_diff(hf, acc, "loss") <= LOSS_TOL, (col(hf, "loss"), col(acc, "loss"))
    assert max_diff(hf, acc, "grad_norm") <= NORM_TOL, (col(hf, "grad_norm"), col(acc, "grad_norm"))
    # the logged rate is the one each step used (read before the scheduler steps)
    assert col(hf, "learning_rate") == pytest.approx(col(acc, "learning_rate"), abs=1e-12)
    assert col(acc, "learning_rate") == pytest.approx(lrs)


@pytest.mark.parametrize("backend", ["accelerate", "trainer"])
@pytest.mark.parametrize("n,max_steps", [(24, 3), (22, -1)])
def test_loss_is_exact_under_accumulation(backend, n, max_steps):
    # 22 examples, one epoch: 4x2's last step has micro-batches of 4 and 2, so a mean of micro-batch
    # means would differ from the exact step mean.
    ref, *_ = run(backend, 8, 1, n=n, max_steps=max_steps)
    assert len(ref) == 3
    for micro, accum in ((4, 2), (2, 4)):
        rows, *_ = run(backend, micro, accum, n=n, max_steps=max_steps)
        assert max_diff(ref, rows, "loss") <= LOSS_TOL, (micro, accum, col(ref, "loss"), col(rows, "loss"))
        assert max_diff(ref, rows, "grad_norm") <= NORM_TOL, (micro, accum, col(ref, "grad_norm"),
                                                               col(rows, "grad_norm"))


def test_step_recorder_rows():
    rows, *_ = run("accelerate", 4, 2)
    assert len(rows) == 3
    for r in rows:
        assert r["samples"] == 8
        assert r["tokens"] > 0
        assert r["step_time_s"] > 0
        assert r["samples_per_second"] > 0 and r["tokens_per_second"] > 0
        assert r["grad_norm"] > 0 and r["loss"] > 0


def test_activation_checkpointing_keeps_the_losses():
    plain, _, plain_on, _ = run("accelerate", 4, 2)
    ckpt, caught, ckpt_on, _ = run("accelerate", 4, 2, checkpointing=True)
    assert (plain_on, ckpt_on) == (False, True)
    assert max_diff(plain, ckpt, "loss") <= LOSS_TOL
    assert max_diff(plain, ckpt, "grad_norm") <= NORM_TOL
    noisy = [w for w in caught if "checkpoint" in w.lower() or "deprecated" in w.lower()]
    assert not noisy, noisy


@pytest.mark.parametrize("n,last_samples", [(24, 8), (20, 4)])
def test_epochs_give_the_same_steps_on_both_backends(n, last_samples):
    hf, *_ = run("trainer", 4, 2, n=n, max_steps=-1)
    acc, *_ = run("accelerate", 4, 2, n=n, max_steps=-1)
    assert len(hf) == len(acc) == 3
    assert col(acc, "samples") == col(hf, "samples") == [8, 8, last_samples]
    assert max_diff(hf, acc, "loss") <= LOSS_TOL, (col(hf, "loss"), col(acc, "loss"))
    assert max_diff(hf, acc, "grad_norm") <= NORM_TOL


# Past one epoch the data is reshuffled (sampler seed + epoch) and the epoch's short last step recurs:
# 20 examples at 8 per step = steps of 8, 8, 4 per epoch; max_steps cuts the second epoch, and
# num_train_epochs=1.5 means ceil(1.5 x 3) = 5 steps, as Trainer counts them.
@pytest.mark.parametrize("max_steps,epochs", [(5, 1.0), (-1, 1.5)])
def test_training_past_one_epoch(max_steps, epochs):
    hf, *_ = run("trainer", 4, 2, n=20, max_steps=max_steps, epochs=epochs)
    acc, *_ = run("accelerate", 4, 2, n=20, max_steps=max_steps, epochs=epochs)
    assert col(acc, "samples") == col(hf, "samples") == [8, 8, 4, 8, 8]
    assert max_diff(hf, acc, "loss") <= LOSS_TOL, (col(hf, "loss"), col(acc, "loss"))
    assert max_diff(hf, acc, "grad_norm") <= NORM_TOL


def test_accelerate_stop_and_resume_gives_the_uninterrupted_losses_and_weights(tmp_path, monkeypatch):
    """Stop after step 2 of 5 (dropout on: the RNG state must resume too), resume from the checkpoint."""
    from transformers import BertForSequenceClassification

    from onegpu.training.backends import accelerate as accel
    monkeypatch.chdir(tmp_path)
    cfg = from_container({"model": {"dropout": 0.1},
                          "train": {"backend": "accelerate", "per_device_train_batch_size": 4,
                                    "gradient_accumulation_steps": 2, "max_steps": 5, "learning_rate": 1e-3,
                                    "logging_steps": 100}})

    def build():
        config = tiny_bert().config
        config.hidden_dropout_prob = config.attention_probs_dropout_prob = 0.1
        torch.manual_seed(0)
        return BertForSequenceClassification(config)

    ref = []
    ref_model, _ = accel.train(TrainRequest(build(), tokenizer(), dataset(24), cfg,
                                            lambda m, s: ref.append(m["loss"])))
    ckpt = tmp_path / "ckpt"
    first, resume = interrupt_at_step_2(
        lambda sink, **kw: accel.train(TrainRequest(build(), tokenizer(), dataset(24), cfg, sink, **kw)), ckpt)
    assert resume is not None and resume.step == 2 and resume.run_id == "r1"
    rest = []
    model, rec = accel.train(TrainRequest(build(), tokenizer(), dataset(24), cfg, lambda m, s: rest.append(m["loss"]),
                                          checkpoint_dir=ckpt, resume=resume))
    assert first + rest == pytest.approx(ref, abs=1e-6)
    assert [r["step"] for r in rec.rows] == [1, 2, 3, 4, 5]
    want = ref_model.state_dict()
    assert max(float((v - want[k]).abs().max()) for k, v in model.state_dict().items()) <= 1e-6


@pytest.mark.slow  # three trainings per backend: ~10 s each
@pytest.mark.parametrize("backend", ["trainer", "accelerate"])
def test_low_bit_adamw_stop_and_resume_gives_the_uninterrupted_losses(backend, tmp_path, monkeypatch):
    """torchao's quantised states (tensor subclasses) go into the checkpoint and come back: stopped after
    step 2 of 5 (both backends) and resumed, the 8-bit AdamW run has the uninterrupted run's
    losses exactly (eager step)."""
    pytest.importorskip("torchao")
    import importlib

    from onegpu.training.backends import base
    monkeypatch.chdir(tmp_path)
    module = importlib.import_module(base.REGISTRY[backend])
    cfg = from_container({"model": {"dropout": 0.0},
                          "train": {"backend": backend, "per_device_train_batch_size": 4, "optim": "adamw_torch_8bit",
                                    "gradient_accumulation_steps": 2, "max_steps": 5, "logging_steps": 100}})

    def train(sink, **kw):
        return module.train(TrainRequest(tiny_bert(None, 128), tokenizer(), dataset(24), cfg, sink, **kw))
    ref, rest = [], []
    with torch.compiler.set_stance("force_eager"):
        train(lambda m, s: ref.append(m["loss"]))
        first, resume = interrupt_at_step_2(train, tmp_path / "ckpt")
        assert resume is not None and resume.step == 2  # both backends: once the step is logged
        train(lambda m, s: rest.append(m["loss"]), checkpoint_dir=tmp_path / "ckpt", resume=resume)
    assert first + rest == ref and len(ref) == 5


def test_trainer_backend_leaves_no_scratch_folders(tmp_path, monkeypatch):
    """Training without a checkpoint folder needs a Trainer output_dir: it is temporary and removed (it was
    left in /tmp, one per training run); evaluation's prediction needs none (it has no Trainer)."""
    import tempfile

    from onegpu.evaluation import predict
    from onegpu.training.backends import hf_trainer
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    cfg = from_container({"model": {"dropout": 0.0}, "train": {"per_device_train_batch_size": 4, "max_steps": 1,
                                                              "logging_steps": 100}})
    model, _ = hf_trainer.train(TrainRequest(tiny_bert(), tokenizer(), dataset(8), cfg, sink=lambda m, s: None))
    out = predict(model, tokenizer(), dataset(8)["train"], cfg)
    assert out.logits.shape == (8, 3)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_one_backend_registry_and_the_config_accepts_exactly_its_names():
    from onegpu import config
    from onegpu.training.backends import base
    assert tuple(base.REGISTRY) == tuple(config.BACKENDS) == ("trainer", "accelerate")
    assert all(callable(base.get(name).train) for name in base.REGISTRY)


def test_accelerate_backend_and_recorder_import_no_hf_trainer():
    """The Accelerate loop and the backend-neutral recorder stand without HF ``Trainer`` and its callbacks."""
    import ast
    from pathlib import Path

    import onegpu.training
    root = Path(onegpu.training.__file__).parent
    for rel in ("backends/accelerate.py", "record/recorder.py", "objectives/batches.py", "lifecycle/interrupt.py",
                "session.py", "tracked_run.py", "record/run_tags.py", "record/closing_record.py", "prepared.py"):
        names = set()
        for node in ast.walk(ast.parse((root / rel).read_text())):
            if isinstance(node, ast.ImportFrom):
                names |= {f"{node.module}.{a.name}" for a in node.names}
        assert not {n for n in names if n.startswith("transformers.") and
                    n.rsplit(".", 1)[1] in ("Trainer", "TrainerCallback", "TrainingArguments")}, rel
        assert not {n for n in names if "backends.hf_trainer" in n}, rel


# -- the single-GPU guide's knobs (issue 12) ------------------------------------------------------

FP32_RTOL = 1e-4  # equivalence.TOLERANCES["fp32"]: the same mathematics with other kernels


def rel_diff(a, b, key="loss"):
    assert len(a) == len(b), f"{len(a)} vs {len(b)} steps"
    return max(abs(x - y) / abs(y) for x, y in zip(col(a, key), col(b, key)))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks that train.tf32 is a no-op without CUDA")
@pytest.mark.parametrize("backend", ["trainer", "accelerate"])
def test_tf32_is_accepted_and_a_no_op_on_cpu(backend):
    on, *_ = run(backend, 4, 2, extra=(("tf32", True),))
    off, *_ = run(backend, 4, 2)
    assert col(on, "loss") == col(off, "loss") and col(on, "grad_norm") == col(off, "grad_norm")


@pytest.mark.parametrize("optim", ["adafactor", "adamw_torch_fused"])
def test_adafactor_and_fused_adamw_take_the_same_steps_on_both_backends(optim):
    hf, _, _, hf_mem = run("trainer", 4, 2, optim=optim)
    acc, _, _, acc_mem = run("accelerate", 4, 2, optim=optim)
    assert col(hf, "step") == col(acc, "step") == [1, 2, 3]
    assert max_diff(hf, acc, "loss") <= LOSS_TOL, (col(hf, "loss"), col(acc, "loss"))
    assert max_diff(hf, acc, "grad_norm") <= NORM_TOL
    # the optimizer state is the optimizer's own: Adafactor's factored moments are far below AdamW's 2 x params
    assert hf_mem["mem_optimizer_bytes"] == acc_mem["mem_optimizer_bytes"]
    adamw_mem = run("trainer", 4, 2)[3]
    ratio = hf_mem["mem_optimizer_bytes"] / adamw_mem["mem_optimizer_bytes"]
    assert (ratio < 0.2) if optim == "adafactor" else ratio == 1.0, ratio


LOW_BIT = pytest.mark.parametrize("optim", ["adamw_torch_8bit", "adamw_torch_4bit"])


def low_bit_pair(optim: str, compiled: bool):
    """Both backends' rows and memory breakdowns with torchao's ``optim`` on the tiny BERT whose four
    feed-forward weights (4,096 elements each) get quantised states; the rest stays fp32 in torchao."""
    pytest.importorskip("torchao")
    hf, _, _, hf_mem = run("trainer", 4, 2, optim=optim, intermediate=128, compiled=compiled)
    acc, _, _, acc_mem = run("accelerate", 4, 2, optim=optim, intermediate=128, compiled=compiled)
    assert col(hf, "step") == col(acc, "step") == [1, 2, 3]
    assert max_diff(hf, acc, "loss") <= LOSS_TOL, (col(hf, "loss"), col(acc, "loss"))
    assert max_diff(hf, acc, "grad_norm") <= NORM_TOL, (col(hf, "grad_norm"), col(acc, "grad_norm"))
    return hf, acc, hf_mem, acc_mem


@LOW_BIT
def test_low_bit_adamw_takes_the_same_steps_on_both_backends(optim):
    """Trainer builds torchao's AdamW8bit/AdamW4bit by name, the accelerate backend with Trainer's kwargs: the
    same steps (run eagerly here, 2-4 s; the compiled step is the slow test below), and the same optimizer
    bytes, which are the estimate's: 89,600 (8-bit) / 113,664 (4-bit) fewer than fp32 AdamW's 8,043,544."""
    from onegpu.training.memory import autobatch
    from tests.unit.tiny import tiny_bert
    hf, acc, hf_mem, acc_mem = low_bit_pair(optim, compiled=False)
    adamw = run("accelerate", 4, 2, intermediate=128, compiled=False)
    assert hf_mem["mem_optimizer_bytes"] == acc_mem["mem_optimizer_bytes"]
    assert hf_mem["mem_optimizer_bytes"] == autobatch.optimizer_state_bytes(tiny_bert(None, 128), optim)
    saved = {"adamw_torch_8bit": 89600, "adamw_torch_4bit": 113664}[optim]
    assert adamw[3]["mem_optimizer_bytes"] - hf_mem["mem_optimizer_bytes"] == saved
    # quantised states: not fp32 AdamW's steps, but close over 3 steps at lr 1e-3 (distance <= 1e-4)
    assert col(acc, "grad_norm") != col(adamw[0], "grad_norm")
    assert max_diff(acc, adamw[0], "loss") <= 1e-4


@pytest.mark.slow  # torchao compiles its step on first use: ~15-30 s on a 2-core CPU
@LOW_BIT
def test_low_bit_adamw_compiled_step_takes_the_same_steps_on_both_backends(optim):
    hf, acc, *_ = low_bit_pair(optim, compiled=True)
    eager = low_bit_pair(optim, compiled=False)[1]
    assert max_diff(acc, eager, "loss") <= LOSS_TOL and max_diff(acc, eager, "grad_norm") <= NORM_TOL


def test_fused_adamw_is_the_same_training_as_adamw_within_fp32_tolerance():
    fused, *_ = run("accelerate", 4, 2, optim="adamw_torch_fused")
    plain, *_ = run("accelerate", 4, 2)
    assert rel_diff(fused, plain) <= FP32_RTOL, (col(fused, "loss"), col(plain, "loss"))
    assert col(fused, "loss") != col(run("accelerate", 4, 2, optim="adafactor")[0], "loss")


@pytest.mark.parametrize("backend", ["trainer", "accelerate"])
def test_sdpa_and_eager_attention_give_the_same_losses(backend):
    sdpa, *_ = run(backend, 4, 2, attn="sdpa")
    eager, *_ = run(backend, 4, 2, attn="eager")
    assert rel_diff(sdpa, eager) <= FP32_RTOL, (col(sdpa, "loss"), col(eager, "loss"))
    assert rel_diff(sdpa, eager, "grad_norm") <= 1e-3


@pytest.mark.parametrize("backend", ["trainer", "accelerate"])
def test_empty_cache_runs_every_n_optimizer_steps_on_both_backends(backend, monkeypatch):
    from onegpu.measure import memory
    calls = []
    monkeypatch.setattr(memory, "empty_cache", lambda: calls.append(1))
    run.__wrapped__(backend, 4, 2, max_steps=4, extra=(("torch_empty_cache_steps", 2),))
    assert len(calls) == 2  # after optimizer steps 2 and 4


def test_trainer_arguments_carry_the_knobs_under_hf_names():
    from onegpu.training.backends.hf_trainer import training_arguments
    cfg = from_container({"train": {"tf32": True, "torch_compile": True, "torch_compile_mode": "max-autotune",
                                    "dataloader_pin_memory": False, "optim": "adafactor"}}, source="test")
    args = training_arguments(cfg, "unused")
    assert args.torch_compile and args.torch_compile_mode == "max-autotune" and args.optim == "adafactor"
    assert args.dataloader_pin_memory is False
    assert args.torch_empty_cache_steps is None  # EmptyCache does it once per optimizer step instead
    if not torch.cuda.is_available():
        assert args.tf32 is None  # a no-op on CPU (TrainingArguments refuses tf32=True there)


def _compile_works() -> str | None:
    try:
        torch.compile(lambda x: x * 2)(torch.ones(2))
    except Exception as e:  # no C compiler for inductor, unsupported platform ...
        return f"torch.compile cannot run here: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["accelerate", "trainer"])
def test_torch_compile_gives_the_eager_losses_within_fp32_tolerance(backend):
    reason = _compile_works()
    if reason:
        pytest.skip(reason)
    compiled, *_ = run(backend, 4, 2, extra=(("torch_compile", True),))
    plain, *_ = run(backend, 4, 2)
    assert rel_diff(compiled, plain) <= FP32_RTOL, (col(compiled, "loss"), col(plain, "loss"))
