"""The bench scripts' process and command line: :func:`setup` isolates the process (offline hub, a temporary
project root and MLflow store, quiet progress bars), :func:`parser` gives the options every script has.

Nothing is fetched from a hub, and the user's MLflow store is never touched: :func:`setup` points
``DVC_ROOT`` at a temporary directory (so ``tracking.connect`` opens ``<tmp>/mlflow.db``), removes every
``MLFLOW_*`` variable, and deletes the directory at exit.
"""
from __future__ import annotations

import argparse
import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

from bench.machine import CONTENTION_LIMIT

BENCH = Path(__file__).resolve().parent


REPO = BENCH.parent

_TMP: Path | None = None


def setup() -> Path:
    """Isolate the process: offline hub, temporary project root and MLflow store, quiet progress bars.

    Must run before transformers/datasets are imported. Returns the temporary directory (removed at exit).
    """
    global _TMP
    if _TMP is not None:
        return _TMP
    from onegpu.models import loader
    loader.go_offline()
    for k in [k for k in os.environ if k.startswith(("MLFLOW_", "DVC_", "HF_MLFLOW_"))]:
        del os.environ[k]
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ["TQDM_DISABLE"] = "1"          # no progress bars (same for every arm)
    _TMP = Path(tempfile.mkdtemp(prefix="onegpu-bench-"))
    (_TMP / "tmp").mkdir()
    os.environ["DVC_ROOT"] = str(_TMP)        # tracking.connect -> sqlite:///<tmp>/mlflow.db
    tempfile.tempdir = str(_TMP / "tmp")      # the trainer backend's scratch output_dir lands here too
    atexit.register(shutil.rmtree, _TMP, ignore_errors=True)
    import signal
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # so atexit runs (timeout)
    import logging
    import warnings
    warnings.filterwarnings("ignore")
    logging.getLogger("mlflow").setLevel(logging.ERROR)
    logging.getLogger("alembic").setLevel(logging.ERROR)
    from datasets.utils.logging import disable_progress_bar
    disable_progress_bar()
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    return _TMP


def tmpdir() -> Path:
    assert _TMP is not None, "call environment.setup() first"
    return _TMP


def parser(description: str, *, reps: int, steps: int, max_length: int = 64, rows: int = 200,
           micro: int | None = None, accum: int | None = None) -> argparse.ArgumentParser:
    """The options every script has (each script adds its own)."""
    p = argparse.ArgumentParser(description=description,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--reps", type=int, default=reps, help="repetitions (medians are reported)")
    p.add_argument("--steps", type=int, default=steps, help="optimizer steps per run (step 1 is warm-up)")
    p.add_argument("--max-length", type=int, default=max_length, help="tokens per example (truncation)")
    p.add_argument("--rows", type=int, default=rows, help="training rows (data.max_train_samples)")
    if micro is not None:
        p.add_argument("--micro", type=int, default=micro, help="micro-batch (per_device_train_batch_size)")
    if accum is not None:
        p.add_argument("--accum", type=int, default=accum, help="gradient_accumulation_steps")
    p.add_argument("--bf16", action="store_true", help="bf16 mixed precision (train.bf16; use on GPU)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--tag", default="", help="suffix for the result files: results/<name>-<tag>.json")
    p.add_argument("--verbose", action="store_true", help="show the Trainer's own output")
    p.add_argument("--max-wait", type=float, default=120.0,
                   help="seconds to wait, before each run, for other processes to stop using the CPU")
    p.add_argument("--retries", type=int, default=2,
                   help="reruns of a run during which other processes used more than "
                        f"{CONTENTION_LIMIT} cores")
    return p
