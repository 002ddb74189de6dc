"""Instruction fine-tuning is exact: a tiny random Llama (grouped-query attention, SwiGLU, tied embeddings)
with the packaged SmolLM2 tokenizer and its chat template, prompt-completion rows whose answers differ in
length, completion-only loss.

Per optimizer step, loss and grad_norm, fp32, dropout 0, within 1e-5 relative: 8 x 1 = 2 x 4 = 1 x 8 on both
backends; padding-free = padded (SDPA and eager, both backends); each example's loss inside a flattened row
equals its loss alone; a stopped and resumed padding-free run equals the uninterrupted one (both backends).
"""
from __future__ import annotations

import functools
import json

import pytest

torch = pytest.importorskip("torch")

from onegpu.config import PACKAGED_CHAT_MODEL, from_container  # noqa: E402

REL = 1e-5
WORDS = ("the bank cut rates as markets rose while the team won the final and a new film opened to fine "
         "reviews after the minister spoke about growth jobs and trade in the north").split()


@functools.cache
def tokenizer():
    """The packaged SmolLM2 tokenizer (its GGUF's tokenizer converted once into this session's cache)."""
    from transformers import AutoTokenizer

    from onegpu.models import packaged
    return AutoTokenizer.from_pretrained(str(packaged.converted_dir(PACKAGED_CHAT_MODEL, tokenizer_only=True)))


def rows(n: int) -> list[dict]:
    """``n`` prompt-completion rows: prompts of 3..20 words, answers of 1..9 words (uneven lengths)."""
    return [{"prompt": "Headline: " + " ".join((WORDS * 3)[i:i + 3 + (5 * i) % 18]),
             "completion": " ".join((WORDS * 3)[2 * i:2 * i + 1 + (3 * i) % 9])} for i in range(n)]


@functools.cache
def dataset(n: int = 16, max_length: int = 64, completion_only=None):
    """The rows as prepare tokenizes them (:func:`onegpu.data.tokenize_instructions`)."""
    from datasets import ClassLabel, Dataset, DatasetDict

    from onegpu.config import DataConfig
    from onegpu.data import tokenize_instructions
    ds = Dataset.from_dict({"prompt": [r["prompt"] for r in rows(n)], "completion": [r["completion"] for r in rows(n)],
                            "label": ["text"] * n})
    ds = ds.cast_column("label", ClassLabel(names=["text"]))
    d = DataConfig(max_length=max_length, completion_only_loss=completion_only)
    out, dropped, _ = tokenize_instructions(DatasetDict(train=ds), tokenizer(), d, "prompt-completion")
    assert dropped == 0
    return out


def tiny_llama(attn: str = "sdpa"):
    from transformers import LlamaConfig, LlamaForCausalLM
    tok = tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=True, attention_dropout=0.0, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, attn_implementation=attn)
    return LlamaForCausalLM(config)


def config(backend: str, micro: int, accum: int, padding_free: bool = False, max_steps: int = 2, **train):
    return from_container({
        "data": {"padding_free": padding_free, "max_length": 64},
        "model": {"task": "causal-lm", "name_or_path": None, "dropout": 0.0},
        "train": {"backend": backend, "per_device_train_batch_size": micro, "gradient_accumulation_steps": accum,
                  "max_steps": max_steps, "learning_rate": 1e-3, "weight_decay": 0.01, "seed": 3,
                  "logging_steps": 100, **train}}, source="test")


@functools.cache
def train(backend: str, micro: int, accum: int, padding_free: bool = False, attn: str = "sdpa",
          completion_only=None) -> tuple:
    import importlib

    from onegpu.training.backends import base
    cfg = config(backend, micro, accum, padding_free)
    module = importlib.import_module(base.REGISTRY[backend])
    data = dataset(completion_only=completion_only)
    _, steps = module.train(base.TrainRequest(tiny_llama(attn), tokenizer(), data, cfg, sink=lambda m, s: None))
    return tuple(steps.rows)


def assert_same_steps(a, b):
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2]
    assert [r["targets"] for r in a] == [r["targets"] for r in b]  # the same completion tokens per step
    for key in ("loss", "grad_norm"):
        x, y = [r[key] for r in a], [r[key] for r in b]
        assert x == pytest.approx(y, rel=REL), (key, x, y)


def test_the_completion_tokens_are_the_targets_and_the_end_of_answer_stays_one():
    ds = dataset()["train"]
    tok = tokenizer()
    assert tok.pad_token_id == tok.eos_token_id  # SmolLM2: pad = eos = <|im_end|>
    lengths = set()
    for r in ds:
        targets = [t for t in r["labels"] if t != -100]
        assert r["labels"][:r["prompt_length"]] == [-100] * r["prompt_length"]
        assert targets == r["input_ids"][r["prompt_length"]:]
        assert tok.decode(targets) == r["reference"] + "<|im_end|>\n"  # the answer, its end token a target
        lengths.add(len(targets))
    assert len(lengths) >= 5  # answers of uneven length: micro-batch means would weight them unequally


@pytest.mark.parametrize("padding_free", [False, True])
def test_collators_keep_the_end_of_answer_token_as_a_target(padding_free):
    from onegpu.training.objectives import collator_for
    tok = tokenizer()
    feats = [{k: dataset()["train"][i][k] for k in ("input_ids", "attention_mask", "labels")} for i in (0, 5)]
    batch = collator_for("causal-lm", tok, padding_free)(feats)
    eos_targets = int((batch["labels"] == tok.eos_token_id).sum())
    assert eos_targets == 2  # one per answer, though pad = eos and the padded row has pad tokens
    if not padding_free:
        assert int((batch["input_ids"] == tok.pad_token_id).sum()) > eos_targets  # padding present


@pytest.mark.parametrize("backend", ["trainer", "accelerate"])
def test_splits_of_the_effective_batch_take_the_same_steps_with_completion_only_loss(backend):
    ref = train(backend, 8, 1)
    for micro, accum in ((2, 4), (1, 8)):
        assert_same_steps(train(backend, micro, accum), ref)


def test_both_backends_take_the_same_completion_only_steps():
    assert_same_steps(train("trainer", 2, 4, True), train("accelerate", 2, 4, True))


@pytest.mark.parametrize("backend,attn,completion_only", [
    ("trainer", "sdpa", None), ("accelerate", "sdpa", None), ("accelerate", "eager", None),
    ("accelerate", "sdpa", False)])  # loss on every token: each sequence's first token must not be a target
def test_padding_free_is_the_same_training_as_padded(backend, attn, completion_only):
    padded = train(backend, 4, 2, False, attn, completion_only)
    flat = train(backend, 4, 2, True, attn, completion_only)
    assert_same_steps(flat, padded)
    assert [r["samples"] for r in flat] == [r["samples"] for r in padded] == [8, 8]  # examples, not rows
    assert [r["tokens"] for r in flat] == [r["tokens"] for r in padded]  # non-padding tokens
    assert [r["tokens_sq"] for r in flat] == [r["tokens_sq"] for r in padded]  # per-sequence attention FLOPs


def _sequence_losses(model, batch, use_cache: bool = False) -> list[float]:
    """Summed next-token loss of each sequence of ``batch`` (padded rows, or one padding-free row), with the
    model's KV cache off as in training (:func:`test_a_kv_cache_hides_the_sequence_boundaries`)."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**inputs, use_cache=use_cache).logits[..., :-1, :]
    labels = batch["labels"][..., 1:]
    per_token = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                                  ignore_index=-100, reduction="none").view(labels.shape)
    if "position_ids" in batch and "attention_mask" not in batch:  # one row: split at the position restarts
        seq = (batch["position_ids"][..., 1:] == 0).cumsum(-1)[0]
        return [float(per_token[0][seq == i].sum()) for i in range(int(seq.max()) + 1)]
    return [float(r.sum()) for r in per_token]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_each_examples_loss_inside_a_flattened_row_equals_its_loss_alone(attn):
    from onegpu.training.objectives import collator_for
    model = tiny_llama(attn).eval()
    feats = [{k: dataset()["train"][i][k] for k in ("input_ids", "attention_mask", "labels")} for i in (1, 2, 3)]
    with torch.no_grad():
        alone = [_sequence_losses(model, collator_for("causal-lm", tokenizer())([f]))[0] for f in feats]
        flat_batch = collator_for("causal-lm", tokenizer(), padding_free=True)(feats)
        flat = _sequence_losses(model, flat_batch)
        # Without restarting positions the sequences share one causal context: the check can fail.
        leaked = dict(flat_batch, position_ids=torch.arange(flat_batch["input_ids"].shape[1])[None])
        contaminated = _sequence_losses(model, leaked)
    assert flat == pytest.approx(alone, rel=REL)
    assert sum(contaminated) != pytest.approx(sum(alone), rel=1e-6)


def test_a_kv_cache_hides_the_sequence_boundaries():
    """transformers (5.24) builds the block-diagonal mask only without a KV cache: with ``use_cache`` on, a
    flattened row is one causal context. Training switches the cache off (both backends, the ``auto``
    finder's and the estimate's probes), so padding-free training never runs with it."""
    from onegpu.training.objectives import collator_for
    model = tiny_llama().eval()
    feats = [{k: dataset()["train"][i][k] for k in ("input_ids", "attention_mask", "labels")} for i in (1, 2)]
    with torch.no_grad():
        alone = _sequence_losses(model, collator_for("causal-lm", tokenizer())([feats[1]]))[0]
        flat = collator_for("causal-lm", tokenizer(), padding_free=True)(feats)
        assert _sequence_losses(model, flat)[1] == pytest.approx(alone, rel=REL)
        assert _sequence_losses(model, flat, use_cache=True)[1] != pytest.approx(alone, rel=1e-6)


def test_packed_rows_keep_their_examples_apart():
    from onegpu.data import packing
    from onegpu.training.objectives import model_inputs
    from onegpu.training.objectives.batches import PaddingFreeCollator
    train_rows = model_inputs(dataset(), "causal-lm")["train"]
    packed = packing.pack(train_rows, 128, seed=0)
    assert len(packed) < len(train_rows) and sum(map(len, packed["seq_lengths"])) == len(train_rows)
    model = tiny_llama().eval()
    by_ids = {tuple(r["input_ids"]): r for r in train_rows}
    row = packed[0]
    assert len(row["seq_lengths"]) >= 2 and sum(row["seq_lengths"]) <= 128
    with torch.no_grad():
        flat = _sequence_losses(model, PaddingFreeCollator()([row]))
        start, alone = 0, []
        for n in row["seq_lengths"]:
            ex = by_ids[tuple(row["input_ids"][start:start + n])]
            alone += _sequence_losses(model, PaddingFreeCollator()([ex]))
            start += n
    assert flat == pytest.approx(alone, rel=REL)


@pytest.mark.parametrize("backend", ["accelerate", "trainer"])
def test_padding_free_stop_and_resume_gives_the_uninterrupted_steps(tmp_path, monkeypatch, backend):
    import importlib

    from onegpu.training.backends import base
    from tests.unit import tiny as tb
    monkeypatch.chdir(tmp_path)
    cfg = config(backend, 2, 2, padding_free=True, max_steps=4)
    module = importlib.import_module(base.REGISTRY[backend])

    def run(sink, **kw):
        return module.train(base.TrainRequest(tiny_llama(), tokenizer(), dataset(), cfg, sink, **kw))
    ref = []
    run(lambda m, s: ref.append((m["loss"], m["grad_norm"])))
    first, resume = tb.interrupt_at_step_2(run, tmp_path / "ckpt")
    # Both backends check for a stop once the step is logged (after its validation pass): step 2.
    assert resume is not None and resume.step == 2
    rest = []
    run(lambda m, s: rest.append((m["loss"], m["grad_norm"])), checkpoint_dir=tmp_path / "ckpt", resume=resume)
    assert len(ref) == 4 and len(rest) == 4 - resume.step
    assert first[:resume.step] == pytest.approx([x for x, _ in ref[:resume.step]], rel=REL)
    assert [x for pair in rest for x in pair] == pytest.approx([x for pair in ref[resume.step:] for x in pair],
                                                               rel=REL)


@pytest.mark.parametrize("key", ["padding_free", "packing"])
def test_a_model_that_builds_its_own_mask_is_refused_for_padding_free(monkeypatch, tmp_path, key):
    """The refusal reads the modeling code: a Llama whose code did not use transformers' create_causal_mask
    (sequences of one row would attend to each other) is named, with the key to switch off; the train
    stage's plan refuses it before it reads the prepared data (none here) or builds anything."""
    import inspect

    from onegpu import config as cfgmod
    from onegpu.errors import ConfigError
    from onegpu.models import loader
    from onegpu.training import session
    assert loader.packed_sequences_problem(None, None) is None  # GPT-2 from config keeps them apart
    real = inspect.getsource
    monkeypatch.setattr(inspect, "getsource", lambda m: real(m).replace("create_causal_mask", "own_mask"))
    assert "builds its attention mask itself" in loader.packed_sequences_problem(None, "sdpa")
    cfg = config("accelerate", 2, 2, padding_free=key == "padding_free")
    cfg.data.packing = key == "packing"
    message = rf"^params.yaml: data.{key}: GPT2LMHeadModel builds its attention mask itself.*set data.{key}: false$"
    with pytest.raises(ConfigError, match=message):
        session.check_flattened(cfg, loader.resolve_model_path(cfg.model.name_or_path))
    monkeypatch.chdir(tmp_path)  # no data/stats.json: the refusal comes first
    with pytest.raises(ConfigError, match=message):
        session.plan(cfg, facts=cfgmod.DeviceFacts())


def test_the_first_micro_batch_holds_one_row_for_each_example_padding_free():
    from onegpu.training import objectives
    cfg = config("accelerate", 4, 2, padding_free=True)
    parts = objectives.training_parts(dataset(), cfg, tokenizer())
    ds = parts.rows
    batch = parts.collator([ds[i] for i in range(4)])
    assert set(batch) == {"input_ids", "labels", "position_ids"} and batch["input_ids"].shape[0] == 1
    assert int((batch["position_ids"] == 0).sum()) == 4
    assert json.dumps(batch["labels"][0][batch["position_ids"][0] == 0].tolist()) == "[-100, -100, -100, -100]"


def _two_process_worker(rank: int, port: int, out_dir: str) -> None:
    """Rank ``rank`` of 2 gloo processes: 2 steps of 2 x 2 per process, padding-free, completion-only, on
    each backend in turn, whole logits then the fused LM head (one process group: a pair of spawned
    processes costs more than the trainings). Writes ``rank<r>.json``: ``{"<backend>[ fused]": the steps'
    step, loss, grad_norm, targets, samples}``."""
    import os
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import importlib

    from onegpu.training.backends import base
    from onegpu.training.parallel import distributed
    distributed.TIMEOUT_S = 60
    from onegpu.training.objectives import lm_head
    out = {}
    for backend, fused in (("trainer", False), ("accelerate", False), ("trainer", True), ("accelerate", True)):
        cfg = config(backend, 2, 2, padding_free=True, num_processes=2)
        model = tiny_llama()
        if fused:
            lm_head.attach(model)
        _, steps = importlib.import_module(base.REGISTRY[backend]).train(
            base.TrainRequest(model, tokenizer(), dataset(), cfg, sink=lambda m, s: None))
        out[backend + " fused" * fused] = [{k: r[k] for k in ("step", "loss", "grad_norm", "targets", "samples")}
                                           for r in steps.rows]
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(out, f)


@pytest.mark.slow
def test_two_processes_take_the_one_process_steps_on_both_backends(tmp_path):
    """2 gloo processes x 2 x 2 (padding-free) = 1 process 2 x 4, on each backend, with the whole logits and
    with the fused LM head (:mod:`onegpu.training.objectives.lm_head`): the step's completion tokens are summed over
    the processes before each divides (trl PR #3538's bug: per-device means)."""
    from tests.unit.training.parallel import test_distributed as td
    ranks = td._spawn(_two_process_worker, tmp_path)
    for backend in ("trainer", "accelerate", "trainer fused", "accelerate fused"):
        assert ranks[0][backend] == ranks[1][backend], backend  # every rank logs the whole step
        assert_same_steps(ranks[0][backend], train(backend.split()[0], 2, 4, True))


def _lora_run(checkpointing: bool, reentrant: bool = False, bf16: bool = False) -> tuple:
    from onegpu.config import LoraConfig
    from onegpu.models import lora
    from onegpu.training.backends import accelerate as accel
    from onegpu.training.backends.base import TrainRequest
    extra = {"gradient_checkpointing": checkpointing, "bf16": bf16}
    if checkpointing:
        extra["gradient_checkpointing_kwargs"] = {"use_reentrant": reentrant, "every_n_layers": 1}
    cfg = config("accelerate", 2, 2, padding_free=True, **extra)
    torch.manual_seed(1)
    model = lora.apply(tiny_llama(), LoraConfig(r=4, alpha=8.0), "causal-lm", checkpointing)
    _, steps = accel.train(TrainRequest(model, tokenizer(), dataset(), cfg, sink=lambda m, s: None))
    return tuple(steps.rows), model


@pytest.mark.parametrize("reentrant", [False, True])
def test_lora_with_checkpointing_trains_the_adapters_and_takes_the_same_steps(reentrant):
    """Under LoRA the frozen embedding's output must require grad, or reentrant checkpointing gives the
    adapters inside a checkpointed layer no gradient (lora.apply: enable_input_require_grads)."""
    plain, _ = _lora_run(False)
    ckpt, model = _lora_run(True, reentrant)
    assert_same_steps(ckpt, plain)
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trained and all("lora_" in n for n in trained)  # peft's Llama default: q_proj, v_proj adapters
    assert any(".q_proj.lora_" in n for n in trained) and any(".v_proj.lora_" in n for n in trained)


def test_bf16_autocast_trains_padding_free_within_bf16_tolerance():
    from accelerate.state import AcceleratorState
    fp32, _ = _lora_run(False)
    AcceleratorState._reset_state(True)  # Accelerate keeps one mixed-precision setting per process
    try:
        bf16, _ = _lora_run(False, bf16=True)
    finally:
        AcceleratorState._reset_state(True)
    assert [r["targets"] for r in bf16] == [r["targets"] for r in fp32]
    assert [r["loss"] for r in bf16] == pytest.approx([r["loss"] for r in fp32], rel=1e-2)


def test_the_auto_finder_probes_flattened_rows():
    from onegpu.training.memory import autobatch
    from onegpu.training.objectives import model_inputs
    from onegpu.training.objectives.batches import PaddingFreeCollator
    from onegpu.training.objectives.loss import causal_lm_loss
    rows = model_inputs(dataset(), "causal-lm")["train"]
    model = tiny_llama()
    model.config.use_cache = False
    micro, probes = autobatch.find_micro_batch(model, rows, PaddingFreeCollator(), causal_lm_loss, 8, 2**40,
                                               "adamw_torch", "cpu")
    assert micro == 8 and probes[0].fits  # a terabyte: the largest divisor fits
    small = probes[0].peak_bytes * 0.6 / autobatch.SAFETY
    micro, probes = autobatch.find_micro_batch(model, rows, PaddingFreeCollator(), causal_lm_loss, 8, int(small),
                                               "adamw_torch", "cpu")
    assert micro in (2, 4) and [p.micro_batch for p in probes][:2] == [8, 4]


@pytest.mark.parametrize("world", [2, 3])
def test_the_own_rows_are_the_epochs_rows_once_under_accelerates_even_batches(world):
    """own_rows against accelerate's own sharding (BatchSamplerShard, even_batches as Trainer sets it): for every
    epoch length and micro-batch, each process's micro-batches begin with own_rows rows of the epoch, the rest
    repeats from its start; over the processes every row once (a micro-batch of repeats only where a process has
    none of its own)."""
    from accelerate.data_loader import BatchSamplerShard
    from torch.utils.data import BatchSampler

    from onegpu.training.objectives.batches import collate_own, own_rows
    for rows in range(1, 23):
        for micro in (1, 2, 3, 4):
            seen = []
            for rank in range(world):
                shard = BatchSamplerShard(BatchSampler(range(rows), micro, drop_last=False), world, rank,
                                          even_batches=True)
                for k, batch in enumerate(shard):
                    own = own_rows(k, rank, world, micro, rows)
                    assert batch[:own] == list(range((k * world + rank) * micro, (k * world + rank) * micro + own))
                    assert len(batch) == micro and all(i < micro * world for i in batch[own:])  # from the start
                    seen.extend(batch[:own])
            assert sorted(seen) == list(range(rows)), (rows, micro)
    assert collate_own([{"x": 1}, {"x": 2}], 1, lambda f: f) == ([{"x": 1}], True)
    assert collate_own([{"x": 1}, {"x": 2}], 0, lambda f: f) == ([{"x": 1}, {"x": 2}], False)


def test_a_steps_micro_batches_keep_their_own_rows_on_the_device():
    """own_micro_batches (both backends' loop): process 1 of 2, micro-batches of 2, an epoch of 5 rows: its 0th
    micro-batch (the epoch's rows 2, 3) whole, its 1st (the epoch's 3rd: repeats only) collated whole and not
    counted."""
    from onegpu.training.objectives.batches import own_micro_batches
    def collate(f):
        return {"x": torch.tensor([r["x"] for r in f])}
    raw = [[{"x": 2}, {"x": 3}], [{"x": 0}, {"x": 1}]]
    out, counted = own_micro_batches(raw, 0, 1, 2, 2, 5, collate, "cpu")
    assert [b["x"].tolist() for b in out] == [[2, 3], [0, 1]] and counted == [True, False]
    out, counted = own_micro_batches(raw[:1], 0, 0, 2, 2, 3, collate, "cpu")  # process 0, 3 rows: whole
    assert [b["x"].tolist() for b in out] == [[2, 3]] and counted == [True]
    # process 0's 1st micro-batch = the epoch's 2nd: row 4 its own, then a repeat
    out, _ = own_micro_batches([[{"x": 2}, {"x": 0}]], 1, 0, 2, 2, 5, collate, "cpu")
    assert [b["x"].tolist() for b in out] == [[2]]
