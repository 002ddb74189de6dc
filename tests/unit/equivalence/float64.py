"""Float64 training runs for the same-training proofs (tests/unit/equivalence/test_same_training*.py: the
knobs' list and the fused head, the other knobs, the classifier, the packaged chat model; one file each so
that the suite's workers share them). Not a test module.

A proof trains a model cast to float64 through onegpu's own backends (the knob applied by the code that
applies it in a real run) and keeps, besides the per-step rows, every parameter's gradient of optimizer
step 1: torch's global optimizer-step pre-hook copies the gradients the first ``optimizer.step()`` is
given (with ``max_grad_norm`` 0 nothing rescales them; under DDP they are all-reduced by then). In float64
rounding is ~1e-16 per operation, so a knob that is the same training agrees within ``REL`` (1e-12),
and a knob that changes anything of the mathematics (a float32 intermediate included) does not.

The optimizer is SGD: AdamW's first update is nearly the sign of each gradient element, so an element whose
exact gradient is zero and whose computed one is rounding noise (~1e-17) takes a full step of either sign,
and the next step's loss moves by ~1e-9 (measured on the packaged chat model, 4 x 2 against 8 x 1): that
is AdamW's amplification of any rounding, not the knob's. Under SGD each later step is as exact as the
first; bench/same_training.py measures the AdamW steps in float32.

Float64 all the way: transformers' Llama computes two things in float32 whatever its input's dtype, its
RMSNorm (``hidden_states.to(torch.float32)``) and its eager attention's softmax (``softmax(...,
dtype=torch.float32)``), which in a float64 model round every layer's normalized hidden state (and, eager,
its attention weights) to float32. Two runs whose hidden states differ by 1e-16 (another summation order)
then round some element to neighbouring float32 values: a jump of ~1e-8 in the loss (measured on the
packaged chat model: a 1e-15 change of any of many single weights moved its loss by 2.1e-8, the same jump
each time, and 1 x 4 against 4 x 1 by 6.5e-8 at step 2 on an Intel Xeon with AVX-512; eager against SDPA
2e-7). :func:`train` runs a float64 model with both in float64 (:func:`float64_throughout`): the same
formulas, nothing of the model rounded to float32. (RoPE's cos and sin are float32 too, but a constant of
the positions, the same in every run.)
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import math

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from bench.same_training import WORDS, yes_no_rows  # the job: one-word answers
from onegpu.config import PACKAGED_CHAT_MODEL, from_container

REL = 1e-12  # relative: loss and grad_norm per step, each parameter's gradient (as a norm) at step 1
NEGLIGIBLE = 1e-3  # a tensor's gradient below this share of the whole gradient's norm: relative to that share

@dataclasses.dataclass
class Run:
    rows: list            # the StepRecorder rows (step, loss, grad_norm, targets, ...)
    grads: dict           # parameter name -> its float64 gradient at optimizer step 1 (summed over the step)


def _name(model, p_name: str) -> str:
    """A parameter's name without the wrappers' prefixes (PEFT, checkpointing wrappers)."""
    return p_name.replace("base_model.model.", "").replace("_checkpoint_wrapped_module.", "")


def _rms_norm_float64(self, hidden_states):
    """``LlamaRMSNorm.forward`` (transformers 5) in its input's dtype instead of float32."""
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def _eager_attention_float64(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """transformers 5's Llama ``eager_attention_forward`` with its softmax in the query's dtype (not float32)."""
    from transformers.models.llama.modeling_llama import repeat_kv
    key_states = repeat_kv(key, module.num_key_value_groups)
    value_states = repeat_kv(value, module.num_key_value_groups)
    attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask
    attn_weights = torch.nn.functional.softmax(attn_weights, dim=-1, dtype=query.dtype)
    attn_weights = torch.nn.functional.dropout(attn_weights, p=dropout, training=module.training)
    attn_output = torch.matmul(attn_weights, value_states).transpose(1, 2).contiguous()
    return attn_output, attn_weights


def _whole(t):
    """A tensor, or a sharded gradient (train.fsdp's DTensor) made whole on every rank (a collective)."""
    from torch.distributed.tensor import DTensor
    return t.full_tensor() if isinstance(t, DTensor) else t


def float64_norms(model) -> int:
    """Give every ``LlamaRMSNorm`` of ``model`` (under any wrapper) :func:`_rms_norm_float64` as its forward;
    the number of norms patched. (Its own forward rounds a float64 input to float32: the module's docstring.)"""
    import types

    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    norms = [m for m in model.modules() if isinstance(m, LlamaRMSNorm)]
    for m in norms:
        m.forward = types.MethodType(_rms_norm_float64, m)
    return len(norms)


@contextlib.contextmanager
def float64_throughout(model):
    """While it is open, ``model``'s RMSNorms (:func:`float64_norms`) and Llama's eager attention
    (transformers looks ``eager_attention_forward`` up in its module at each call: replaced by
    :func:`_eager_attention_float64`, put back on exit) compute in float64."""
    from transformers.models.llama import modeling_llama
    float64_norms(model)
    own = modeling_llama.eager_attention_forward
    modeling_llama.eager_attention_forward = _eager_attention_float64
    try:
        yield model
    finally:
        modeling_llama.eager_attention_forward = own


def train(model, tokenizer, dsd, train_cfg: dict, model_cfg: dict, data_cfg: dict | None = None,
          oom_injector=None, dtype=torch.float64) -> Run:
    """``model`` (cast to ``dtype``) trained by ``train_cfg['backend']`` (default ``trainer``) on ``dsd``."""
    from onegpu.training.backends import base
    model = model.to(dtype)
    cfg = from_container({"data": {"max_length": 64, **(data_cfg or {})}, "model": {"dropout": 0.0, **model_cfg},
                          "train": {"max_steps": 3, "optim": "sgd", "learning_rate": 1e-3, "weight_decay": 0.01,
                                    "seed": 3, "max_grad_norm": 0.0, "logging_steps": 100, **train_cfg}},
                         source="test")
    grads = {}

    def hold(optimizer, args, kwargs):  # before every optimizer step: the gradients it steps with
        if not grads:  # the first: optimizer step 1 (the names now: train.fsdp replaces the parameters by shards)
            names = {id(p): _name(model, n) for n, p in model.named_parameters() if p.requires_grad}
            grads.update({names[id(p)]: _whole(p.grad).detach().clone() for group in optimizer.param_groups
                          for p in group["params"] if id(p) in names and p.grad is not None})
    handle = register_optimizer_step_pre_hook(hold)
    try:
        module = importlib.import_module(base.REGISTRY[cfg.train.backend])
        with float64_throughout(model) if dtype == torch.float64 else contextlib.nullcontext():
            _, steps = module.train(base.TrainRequest(model, tokenizer, dsd, cfg, sink=lambda m, s: None,
                                                      oom_injector=oom_injector))
    finally:
        handle.remove()
    rows = list(steps.rows)
    norm = float(torch.nn.utils.get_total_norm(list(grads.values())))  # as the backends compute grad_norm
    logged, bound = rows[0]["grad_norm"], cfg.train.max_grad_norm
    expected = logged * min(1.0, bound / (logged + 1e-6)) if bound else logged  # the step's grads are clipped
    sharded = (train_cfg.get("fsdp") or {}).get("enabled")  # its norm: of shards (test_same_training_packaged.py)
    assert abs(norm - expected) <= (1e-6 if dtype != torch.float64 else 1e-11 if sharded else REL) * norm, \
        f"the held gradients are not step 1's: norm {norm!r}, logged {rows[0]['grad_norm']!r}, {len(grads)} tensors"
    return Run(rows, grads)


def distance(a: Run, b: Run) -> dict:
    """Largest relative differences of ``a`` from ``b``: ``loss`` and ``grad_norm`` over the steps,
    ``gradient`` over the parameters (``|g_a - g_b| / max(|g_b|, NEGLIGIBLE |g|)`` per tensor, L2 norms, ``g``
    the whole gradient), and which tensor."""
    def rel(x, y):
        return abs(x - y) / abs(y) if y else abs(x)
    out = {k: max(rel(r[k], s[k]) for r, s in zip(a.rows, b.rows)) for k in ("loss", "grad_norm")}
    assert a.grads.keys() == b.grads.keys(), sorted(set(a.grads) ^ set(b.grads))
    # A tensor whose gradient is below NEGLIGIBLE of the whole gradient's norm (BERT's key biases: zero in
    # exact arithmetic, as softmax ignores a shift of every key) is measured against that much instead.
    whole = math.sqrt(sum(float(g.square().sum()) for g in b.grads.values()))
    per = {n: float((a.grads[n] - g).norm() / max(float(g.norm()), NEGLIGIBLE * whole))
           for n, g in b.grads.items()}
    out["gradient"], out["tensor"] = max((v, n) for n, v in per.items())
    return out


def assert_same(a: Run, b: Run, rel: float = REL, steps: int = 2) -> None:
    """``a`` is ``b``'s training: the same steps (at least ``steps``) and targets, loss and grad_norm at every
    step and every parameter's step-1 gradient within ``rel`` relative."""
    assert [r["step"] for r in a.rows] == [r["step"] for r in b.rows] and len(a.rows) >= steps
    assert [r["targets"] for r in a.rows] == [r["targets"] for r in b.rows]
    d = distance(a, b)
    assert max(d["loss"], d["grad_norm"], d["gradient"]) <= rel, d


# -- the jobs: data and models --

def chat_tokenizer():
    """The packaged SmolLM2 tokenizer, converted once (tests/unit/training/objectives/test_batches.py's)."""
    from tests.unit.training.objectives import test_batches
    return test_batches.tokenizer()


def answer_rows(n: int) -> dict:
    """``n`` prompt-completion rows whose answers have 1..9 words: 3 to 9 target tokens a row (with the
    end of answer), so the micro-batches of a split hold different numbers of targets. The splits are
    proven on these rows: on rows of equal targets (``yes_no``: 3 each) a loss that averaged each
    micro-batch's own mean would give the same number as the exact one, and the proof could not see it
    (test_same_training_knobs.py plants that loss)."""
    return {"prompt": ["Headline: " + " ".join((WORDS * 3)[i:i + 3 + (5 * i) % 18]) for i in range(n)],
            "completion": [" ".join((WORDS * 3)[2 * i:2 * i + 1 + (3 * i) % 9]) for i in range(n)]}


def chat_rows(n: int) -> dict:
    """``n`` two-turn conversations (system, user, assistant, user, assistant) with answers of 1..6 words."""
    conv = []
    for i in range(n):
        a, b = (WORDS * 3)[i:i + 1 + i % 6], (WORDS * 3)[3 * i:3 * i + 1 + (2 * i) % 5]
        conv.append([{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": " ".join((WORDS * 2)[i:i + 4 + i % 9]) + "?"},
                     {"role": "assistant", "content": " ".join(a)},
                     {"role": "user", "content": "And then?"},
                     {"role": "assistant", "content": " ".join(b)}])
    return {"messages": conv}


@functools.cache
def instruction_data(kind: str, n: int = 8, max_length: int = 64, assistant_only: bool = False):
    """The rows of ``kind`` (``yes_no``, ``answers``, ``chat``) tokenized as prepare does."""
    from datasets import ClassLabel, Dataset, DatasetDict

    from onegpu.config import DataConfig
    from onegpu.data import tokenize_instructions
    cols = {"yes_no": yes_no_rows, "answers": answer_rows, "chat": chat_rows}[kind](n)
    ds = Dataset.from_dict({**cols, "label": ["text"] * n}).cast_column("label", ClassLabel(names=["text"]))
    fmt = "messages" if kind == "chat" else "prompt-completion"
    d = DataConfig(max_length=max_length, assistant_only_loss=assistant_only)
    out, dropped, _ = tokenize_instructions(DatasetDict(train=ds), chat_tokenizer(), d, fmt)
    assert dropped == 0
    return out


# The from-config model's shapes: ``smollm2`` is SmolLM2-135M-Instruct's width (make test-all); ``narrow``, its
# tiny twin (make test), keeps the vocabulary, the tied head and the grouped-query attention at a width of 64.
SHAPES = {"smollm2": {},
          "narrow": {"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
                     "head_dim": 16}}
_shape = ["smollm2"]  # the shape smollm2_shaped builds (model_shape sets it)


@contextlib.contextmanager
def model_shape(name: str):
    """Within the block :func:`smollm2_shaped` (and so :func:`lm_run` and :func:`dpo_run`) builds the ``name``
    shape of :data:`SHAPES`."""
    before, _shape[0] = _shape[0], name
    try:
        yield name
    finally:
        _shape[0] = before


def current_shape() -> str:
    return _shape[0]


def smollm2_shaped(layers: int = 2, attn: str = "sdpa", tied: bool = True):
    """A random-init LlamaForCausalLM of SmolLM2-135M-Instruct's config (hidden 576, 9/3 heads of 64,
    SwiGLU 1,536, vocabulary 49,152, tied embeddings unless ``tied`` is False) with ``layers`` of its 30
    layers (the width and vocabulary, where the output layer's arithmetic lives, are the model's); in
    :func:`model_shape` ``"narrow"``, at a width of 64 (:data:`SHAPES`)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from onegpu.models import packaged
    config = AutoConfig.from_pretrained(str(packaged.converted_dir(PACKAGED_CHAT_MODEL)))
    config.num_hidden_layers, config.tie_word_embeddings, config.use_cache = layers, tied, False
    for key, value in SHAPES[current_shape()].items():
        setattr(config, key, value)
    config._attn_implementation = attn
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def packaged_chat_model(attn: str = "sdpa"):
    """The packaged SmolLM2-135M-Instruct (converted once per test run), float32 as loaded."""
    from onegpu.models import loader
    return loader.build_causal_lm(loader.resolve_model_path(PACKAGED_CHAT_MODEL), chat_tokenizer(), None, 64, 0.0,
                                  attn)


# -- the runs of the proofs: one per job --

CAUSAL = {"task": "causal-lm", "name_or_path": None}


def lm_run(kind: str = "yes_no", micro: int = 8, accum: int = 1, fused: bool = True, backend: str = "trainer",
           attn: str = "sdpa", padding_free: bool = False, checkpointing: tuple = (), tied: bool = True,
           lora: bool = False, dtype=torch.float64) -> Run:
    """2 optimizer steps of the from-config model (:func:`smollm2_shaped`), 8 rows of ``kind`` per step."""
    from onegpu.training.objectives import lm_head
    model = smollm2_shaped(attn=attn, tied=tied)
    if lora:
        from onegpu.config import LoraConfig
        from onegpu.models import lora as lora_mod
        torch.manual_seed(1)
        model = lora_mod.apply(model, LoraConfig(r=4, alpha=8.0), "causal-lm", bool(checkpointing))
        for n, p in model.named_parameters():  # a non-zero B: the adapters' gradients reach every matrix
            if "lora_B" in n:
                torch.nn.init.normal_(p, std=0.02)
    if fused:
        lm_head.check(model, "smollm2-shaped")
        lm_head.attach(model)
    ckpt = dict(checkpointing)
    cfg = {"backend": backend, "per_device_train_batch_size": micro, "gradient_accumulation_steps": accum,
           "gradient_checkpointing": bool(ckpt), "max_steps": 2}
    if ckpt:
        cfg["gradient_checkpointing_kwargs"] = ckpt
    data = instruction_data(kind, 16, assistant_only=kind == "chat")
    return train(model, chat_tokenizer(), data, cfg, CAUSAL,
                 {"padding_free": padding_free, "assistant_only_loss": kind == "chat"}, dtype=dtype)


def classifier_run(micro: int = 8, accum: int = 1, backend: str = "trainer", attn: str | None = None,
                   oom_injector=None, rows: int = 16, **train_cfg) -> Run:
    """2 optimizer steps of the packaged all-MiniLM-L6-v2 classifier (3 labels) on ``rows`` tiny rows (14: the
    second step holds 6 rows, so a split's micro-batches hold different numbers of rows in it)."""
    from onegpu.config import PACKAGED_MODEL
    from onegpu.models import loader
    from tests.unit import tiny
    torch.manual_seed(0)
    model = loader.build_classifier(loader.resolve_model_path(PACKAGED_MODEL), ["a", "b", "c"], 0.0, attn)
    cfg = {"backend": backend, "per_device_train_batch_size": micro, "gradient_accumulation_steps": accum,
           "max_steps": 2, **train_cfg}
    return train(model, tiny.tokenizer(), tiny.dataset(rows), cfg, {}, oom_injector=oom_injector)


def packaged_run(micro: int = 8, accum: int = 1, fused: bool = True, backend: str = "trainer",
                 padding_free: bool = False, dtype=torch.float64, steps: int = 2, attn: str = "sdpa",
                 kind: str = "yes_no", **train_cfg) -> Run:
    """``steps`` optimizer steps of the packaged SmolLM2-135M-Instruct (attention ``attn``) on ``micro *
    accum`` rows of ``kind`` each, times ``num_processes`` (the effective batch; ``yes_no``: the one-word answers
    of the issue's job)."""
    from onegpu.training.objectives import lm_head
    model = packaged_chat_model(attn)
    if fused:
        lm_head.attach(model)
    cfg = {"backend": backend, "per_device_train_batch_size": micro, "gradient_accumulation_steps": accum,
           "max_steps": steps, **train_cfg}
    model_cfg = {**CAUSAL, "name_or_path": PACKAGED_CHAT_MODEL, "attn_implementation": attn}
    rows = micro * accum * steps * train_cfg.get("num_processes", 1)
    return train(model, chat_tokenizer(), instruction_data(kind, rows), cfg, model_cfg,
                 {"source": "pairs.jsonl", "padding_free": padding_free}, dtype=dtype)


# -- preference pairs (DPO) --

PREFERENCE = {"task": "preference", "name_or_path": None}


def pair_rows(n: int) -> dict:
    """``n`` preference rows whose chosen and rejected answers have 1..9 and 1..7 words (different lengths
    within a pair and across pairs: the micro-batches of a split hold different target counts)."""
    words = WORDS * 4
    return {"prompt": ["Headline: " + " ".join(words[i:i + 3 + (5 * i) % 18]) for i in range(n)],
            "chosen": [" ".join(words[2 * i:2 * i + 1 + (3 * i) % 9]) for i in range(n)],
            "rejected": [" ".join(words[3 * i + 1:3 * i + 2 + (5 * i) % 7]) for i in range(n)]}


@functools.cache
def preference_data(n: int = 8, max_length: int = 64):
    """:func:`pair_rows` tokenized as prepare does (:func:`onegpu.data.preference.tokenize_pairs`)."""
    from datasets import ClassLabel, Dataset, DatasetDict

    from onegpu.data.preference import tokenize_pairs
    ds = Dataset.from_dict({**pair_rows(n), "label": ["text"] * n}).cast_column("label", ClassLabel(names=["text"]))
    out, dropped, _ = tokenize_pairs(DatasetDict(train=ds), chat_tokenizer(), max_length)
    assert dropped == 0
    return out


def dpo_run(micro: int = 8, accum: int = 1, pairs: int = 8, steps: int = 2, fused: bool = True,
            backend: str = "trainer", padding_free: bool = False, lora: bool = False, dpo: dict | None = None,
            rows: int | None = None, packaged: bool = False, dtype=torch.float64, oom_injector=None,
            tiny: bool = False, **train_cfg) -> Run:
    """``steps`` optimizer steps of DPO on the from-config model (:func:`smollm2_shaped`), ``pairs`` pairs per
    step (``rows`` pairs of data, default ``pairs x steps``: fewer repeat them in another epoch), its reference
    set up as the stage sets it (the objective's ``prepare_model``, after the cast). ``packaged``: the packaged
    SmolLM2-135M-Instruct itself; ``tiny``: a hidden-32 Llama of its vocabulary
    (tests/unit/training/objectives/test_batches.py).
    ``train_cfg``: more ``train`` keys (``num_processes``, ``fsdp``...)."""
    from onegpu.training import objectives
    from onegpu.training.objectives import lm_head
    if tiny:
        from tests.unit.training.objectives.test_batches import tiny_llama
    model = packaged_chat_model() if packaged else tiny_llama() if tiny else smollm2_shaped()
    if lora:
        from onegpu.config import LoraConfig
        from onegpu.models import lora as lora_mod
        torch.manual_seed(1)
        model = lora_mod.apply(model, LoraConfig(r=4, alpha=8.0), "preference", False)
    if fused:
        lm_head.attach(model)
    model = model.to(dtype)
    if dtype == torch.float64:
        float64_norms(model)  # before the reference is copied from it: the copy computes as the policy
    train_cfg = {"backend": backend, "per_device_train_batch_size": micro, "gradient_accumulation_steps": accum,
                 "max_steps": steps, "dpo": dpo or {}, **train_cfg}
    cfg = from_container({"model": {**PREFERENCE, **({"lora": {"r": 4, "alpha": 8.0}} if lora else {})},
                          "data": {"source": "pairs.jsonl", "padding_free": padding_free}, "train": train_cfg},
                         source="test")
    objectives.get("preference").prepare_model(model, cfg)
    data = objectives.get("preference").prepared_data(preference_data(rows or pairs * steps), model, chat_tokenizer(),
                                                      cfg)  # (as session.train: a precomputed reference's columns)
    return train(model, chat_tokenizer(), data, train_cfg,
                 {**PREFERENCE, **({"lora": {"r": 4, "alpha": 8.0}} if lora else {})},
                 {"source": "pairs.jsonl", "padding_free": padding_free}, dtype=dtype, oom_injector=oom_injector)


# -- GRPO: prompts with an answer, the step's completions sampled in the step --

GRPO = {"task": "grpo", "name_or_path": None}


def text_reward(prompts, completions, answer, **columns) -> list[float]:
    """A reward that varies within every group of a random model's completions: the share of the completion's
    characters that are letters from the first half of the alphabet (tests only; ``train.grpo.reward_funcs``
    takes it by dotted path)."""
    return [sum(c.isalpha() and c.lower() < "n" for c in text) / max(len(text), 1) for text in completions]


TEXT_REWARD = "tests.unit.equivalence.float64:text_reward"


@functools.cache
def grpo_data(n: int = 4, max_length: int = 64):
    """``n`` arithmetic prompts with their answers, tokenized as prepare does
    (:func:`onegpu.data.prompt_answer.tokenize_prompts`)."""
    from datasets import ClassLabel, Dataset, DatasetDict

    from onegpu.data.prompt_answer import tokenize_prompts
    prompts = [f"What is {i} + {2 * i + 1}? " + " ".join(WORDS[:1 + (3 * i) % 7]) for i in range(n)]
    ds = Dataset.from_dict({"prompt": prompts, "answer": [str(3 * i + 1) for i in range(n)], "label": ["text"] * n})
    out, dropped, _ = tokenize_prompts(DatasetDict(train=ds.cast_column("label", ClassLabel(names=["text"]))),
                                       chat_tokenizer(), max_length)
    assert dropped == 0
    return out


def grpo_config(train_cfg: dict, grpo: dict | None = None):
    """``train_cfg`` with :func:`grpo_run`'s ``train.grpo`` (4 completions a prompt, 6 tokens each,
    :data:`TEXT_REWARD`; ``grpo`` overrides) and no validation, as a GRPO run's Config and the ``train`` dict."""
    grpo = {"num_generations": 4, "max_completion_length": 6, "reward_funcs": [TEXT_REWARD], **(grpo or {})}
    train_cfg = {"grpo": grpo, "eval_strategy": "no", "learning_rate": 1e-1, **train_cfg}
    return from_container({"model": GRPO, "data": {"source": "prompts.jsonl"}, "train": train_cfg},
                          source="test"), train_cfg


def grpo_model(cfg, prompts: int, fused: bool = True, dtype=torch.float64, packaged: bool = False):
    """``(model, data)``: the hidden-32 Llama of the packaged tokenizer's vocabulary
    (tests/unit/training/objectives/test_batches.py; ``packaged``: the packaged SmolLM2-135M-Instruct itself) in
    ``dtype``, set up for ``cfg`` as the stage sets it (the objective's ``prepare_model`` and ``prepared_data``),
    and :func:`grpo_data` of ``prompts`` prompts."""
    from onegpu.training import objectives
    from onegpu.training.objectives import lm_head
    from tests.unit.training.objectives.test_batches import tiny_llama
    model = packaged_chat_model() if packaged else tiny_llama()
    # One token in 8 ends a completion (a random model's completions then end at uneven lengths, so a group's
    # advantages do not cancel in the loss; the tokenizer's EOS stays one of them).
    model.generation_config.eos_token_id = list(range(0, model.config.vocab_size, 8))
    if fused:
        lm_head.attach(model)
    model = model.to(dtype)
    if dtype == torch.float64:
        float64_norms(model)
    objective = objectives.get("grpo")
    objective.prepare_model(model, cfg)
    return model, objective.prepared_data(grpo_data(prompts), model, chat_tokenizer(), cfg)


def grpo_run(micro: int = 8, accum: int = 1, prompts: int = 2, steps: int = 2, fused: bool = True,
             backend: str = "trainer", grpo: dict | None = None, rows: int | None = None, dtype=torch.float64,
             packaged: bool = False, oom_injector=None, **train_cfg) -> Run:
    """``steps`` optimizer steps of GRPO (:func:`grpo_model`, :func:`grpo_config`), ``prompts`` prompts of 4
    completions each per step (``rows`` prompts of data, default ``prompts x steps``; ``packaged``: the packaged
    SmolLM2-135M-Instruct)."""
    cfg, train_cfg = grpo_config({"backend": backend, "per_device_train_batch_size": micro,
                                  "gradient_accumulation_steps": accum, "max_steps": steps, **train_cfg}, grpo)
    model, data = grpo_model(cfg, rows or prompts * steps, fused, dtype, packaged)
    return train(model, chat_tokenizer(), data, train_cfg, GRPO, {"source": "prompts.jsonl"}, dtype=dtype,
                 oom_injector=oom_injector)
