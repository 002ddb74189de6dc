"""trl, gguf and rouge-score are for instruction fine-tuning only (packing, the packaged GGUF model, ROUGE-L):
no onegpu module and no bench script of the GPU check imports them when it is imported, so the classifier
and bench/gpu_check.sh run on a machine without them (the GPU machine has none of the three; the check carries
trl for its SFT sections, bench/gpu_env.py)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
SFT_ONLY = ("trl", "gguf", "rouge_score")

# Every onegpu module (as bench/gpu_preflight.py walks them) and the bench scripts the GPU check runs.
CODE = """
import importlib, pkgutil, sys
import onegpu
mods = [m.name for m in pkgutil.walk_packages(onegpu.__path__, "onegpu.")
        if m.name != "onegpu.ui" and not m.name.endswith(".__main__")]
mods += ["bench.arms", "bench.environment", "bench.machine", "bench.reporting", "bench.mfu", "bench.store_check",
         "bench.gpu_models", "bench.split_sweep", "bench.checkpointing", "bench.gpu_preflight", "bench.vs_trl",
         "bench.memory_knobs"]
for m in mods:
    importlib.import_module(m)
print(len(mods), sorted({m.split(".")[0] for m in sys.modules} & set(sys.argv[1:])))
"""


def test_no_module_imports_trl_gguf_or_rouge_score_at_import_time():
    p = subprocess.run([sys.executable, "-c", CODE, *SFT_ONLY], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-2000:]
    out = p.stdout.split(None, 1)
    assert int(out[0]) > 60 and out[1].strip() == "[]", out  # every module imported, none of the three
