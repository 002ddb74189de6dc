"""onegpu.imports: an ``onegpu`` command process (``interpreter.start()``) leaves transformers' torchao and
scipy.optimize imports out, and still gets torchao's low-bit AdamW when ``train.optim`` asks for it. Each case in a
fresh interpreter: the test process imported transformers long ago."""
from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("torchao")

# A stage's imports: a model class, Trainer and its optimizer table, after the command's start (or not).
IMPORTS = """
import sys
if sys.argv[1] == "start":
    from onegpu import interpreter
    interpreter.start()
from transformers import BertForSequenceClassification, LlamaForCausalLM, Trainer, TrainingArguments
print(sorted(m for m in ("torchao", "scipy.optimize") if m in sys.modules))
"""

LOW_BIT = """
import sys
from onegpu import interpreter
interpreter.start()
from transformers import Trainer
from onegpu.config import from_container
from onegpu.training.backends import hf_trainer
cfg = from_container({"train": {"optim": sys.argv[1]}}, source="test")
args = hf_trainer.training_arguments(cfg, sys.argv[2])
cls, _ = Trainer.get_optimizer_cls_and_kwargs(args)
print(cls.__module__, cls.__name__)
"""


def _run(code: str, *args: str) -> str:
    p = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout.strip().splitlines()[-1]


def test_a_commands_process_imports_neither_torchao_nor_scipy_optimize_with_transformers():
    assert _run(IMPORTS, "start") == "[]"
    assert _run(IMPORTS, "library") == "['scipy.optimize', 'torchao']"  # as transformers does by itself


@pytest.mark.parametrize("optim, name", [("adamw_torch_8bit", "AdamW8bit"), ("adamw_torch_4bit", "AdamW4bit")])
def test_torchaos_low_bit_adamw_is_there_when_train_optim_asks_for_it(tmp_path, optim, name):
    module, cls = _run(LOW_BIT, optim, str(tmp_path)).split()
    assert module.startswith("torchao.") and cls == name
