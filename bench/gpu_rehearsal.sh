#!/usr/bin/env bash
# The GPU check rehearsed here, without a GPU, on an environment that holds only what the lent GPU machine
# has: the first lent GPU runs bench/gpu_check.sh at the first try or this fails first. Run after
# bench/gpu_wheels.sh; everything it makes is under the git-ignored .gpu-rehearsal/.
#   1. .gpu-wheels/ (what travels) is complete for CPython 3.12, one version per package, none of the
#      machine's own, under 40 MiB (python -m bench.gpu_env check): a missing wheel fails here.
#   2. The same pins downloaded for CPython 3.11 (.gpu-rehearsal/wheels-cp311/): checked the same way and
#      for the same packages and versions as .gpu-wheels/.
#   3. CPython 3.12 (the machine's Python; no CPU torch for it on the registry): a venv of the machine's
#      packages those wheels need, the cp312 wheels installed --no-index --no-deps into a target folder,
#      then python -m bench.gpu_preflight --carried-only (every carried library imports; dvc runs; MLflow
#      on SQLite, datasets and OmegaConf work; trl and torchao need torch: step 4 imports and runs them).
#   4. CPython 3.11 with the CPU torch 2.13.0 in place of the machine's CUDA torch 2.11: a venv of the
#      machine's packages the check uses, at the machine's versions where known (transformers 5.17.0,
#      accelerate 1.15.0, huggingface-hub 1.33.0, tokenizers 0.23.2, safetensors 0.8.0; numpy 2.5.2 needs
#      3.12, so the lock's), the lock's elsewhere; every package pip adds that the machine lacks is removed.
#      Then `SMOKE=1 bench/gpu_check.sh` on it exactly as on the machine (GPU_PYTHON: no .venv, the cp311
#      wheels installed --no-index --no-deps by the check itself) through every section; it must pass, and
#      its results must be what comes back from the machine (at most 8 files, 16 MiB each, "random init").
# What it does not prove: CUDA kernels, bf16/compile/memory behaviour on the GPU and the GPU's timings
# (all sections run at SMOKE sizes on the CPU); torch 2.11's own behaviour (the rehearsal has 2.13 CPU);
# the cp312 wheels running the pipeline (step 3 imports and exercises them; step 4 runs the cp311 twins);
# machine packages whose version the machine's list does not give (the lock's stand in).
#
#   bash bench/gpu_wheels.sh && bash bench/gpu_rehearsal.sh
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
RH=$REPO/.gpu-rehearsal
T0=$(date +%s)
find_python() {  # VERSION: the first interpreter of that version that runs (a pyenv shim may not)
    local c
    for c in "python$1" "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$1".*/bin/"python$1" /usr/bin/"python$1"; do
        if "$c" -c 'import sys, venv; sys.exit(sys.version_info[:2] != tuple(map(int, sys.argv[1].split("."))))' \
            "$1" >/dev/null 2>&1; then command -v "$c"; return 0; fi
    done
    return 1
}
PY311=${REHEARSAL_PYTHON311:-$(find_python 3.11 || true)}
PY312=${REHEARSAL_PYTHON312:-$(find_python 3.12 || true)}
[ -n "$PY311" ] || { echo "gpu_rehearsal: no Python 3.11 (the CPU torch 2.13.0 file is for 3.11): set REHEARSAL_PYTHON311"; exit 2; }
[ -n "$PY312" ] || { echo "gpu_rehearsal: no Python 3.12 (the lent machine's Python): set REHEARSAL_PYTHON312"; exit 2; }
echo "gpu_rehearsal: Python 3.12 $PY312, Python 3.11 $PY311"
mkdir -p "$RH"
quiet_pip() { grep -v -e '^WARNING: Location' -e '^\[notice\]' || true; }

echo "== 1/4 the wheels that travel: .gpu-wheels (CPython 3.12)"
python3 -m bench.gpu_env check .gpu-wheels --python-version 3.12

echo "== 2/4 the same pins for CPython 3.11"
GPU_WHEELS="$RH/wheels-cp311" GPU_PYTHON_VERSION=3.11 PYTHON="$PY311" bash bench/gpu_wheels.sh | tail -n 1
python3 -m bench.gpu_env check "$RH/wheels-cp311" --python-version 3.11 --same-as .gpu-wheels

machine_venv() {  # VENV PYTHON PYVER REQS_FILTER...: a venv of the machine's packages, rebuilt when they change
    local venv=$1 py=$2 pyver=$3 stamp
    shift 3
    python3 -m bench.gpu_env machine-reqs --python-version "$pyver" | grep -v -x -E "${1:-^$}" >"$venv.reqs"
    stamp=$({ cat "$venv.reqs"; echo "$py torch==2.13.0 recipe 2"; } | sha256sum | cut -c1-16)  # recipe: bump on change
    [ -f "$venv/.stamp" ] && [ "$(cat "$venv/.stamp")" = "$stamp" ] && return 0
    rm -rf "$venv"
    "$py" -m venv "$venv"
    # 3.11: the CPU torch first (from this machine's disk), so nothing pulls a CUDA build; 3.12 takes
    # no package that needs torch (the filter), so none is pulled.
    [ "$pyver" = 3.11 ] && "$venv/bin/python" -m pip install -q --progress-bar off -c "$venv.reqs" torch==2.13.0 2>&1 | quiet_pip
    "$venv/bin/python" -m pip install -q --progress-bar off -c "$venv.reqs" -r "$venv.reqs" 2>&1 | quiet_pip
    # Only what the machine has: drop what pip added beyond its list (the carried wheels bring their own).
    local extra
    extra=$("$venv/bin/python" - "$REPO" <<'EOF'
import importlib.metadata as md, sys
sys.path.insert(0, sys.argv[1])
from bench.gpu_env import machine, norm
have = machine()
print(" ".join(sorted({d.metadata["Name"] for d in md.distributions() if norm(d.metadata["Name"]) not in have})))
EOF
)
    if [ -n "$extra" ]; then
        echo "  removed, not on the machine: $extra"
        "$venv/bin/python" -m pip uninstall -q -y $extra
    fi
    echo "$stamp" >"$venv/.stamp"
}

echo "== 3/4 CPython 3.12: the cp312 wheels install --no-index --no-deps and work (no torch)"
# Only the machine packages the carried libraries import (not the ML stack, which needs torch).
machine_venv "$RH/venv312" "$PY312" 3.12 \
    '(accelerate|peft|transformers|tokenizers|safetensors|sentence-transformers|scikit-learn|scipy|matplotlib|contourpy|fonttools|kiwisolver|pillow|sympy|mpmath|pytest|pytest-xdist|execnet|iniconfig|pluggy|nvidia-ml-py|regex|joblib|threadpoolctl|cycler|narwhals)==.*|(execnet|pytest-xdist)'
rm -rf "$RH/site312"
"$RH/venv312/bin/python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$RH/site312" \
    .gpu-wheels/*.whl 2>&1 | quiet_pip
(cd "$REPO" && PYTHONPATH="$RH/site312" "$RH/venv312/bin/python" -m bench.gpu_preflight --carried-only)

echo "== 4/4 CPython 3.11 with CPU torch: SMOKE=1 bench/gpu_check.sh as on the machine"
machine_venv "$RH/venv" "$PY311" 3.11
rm -rf "$RH/out"
GPU_PYTHON="$RH/venv/bin/python" GPU_WHEELS="$RH/wheels-cp311" SMOKE=1 bash bench/gpu_check.sh "$RH/out"
python3 - "$RH/out" <<'EOF'
import sys, tarfile
from pathlib import Path
out = Path(sys.argv[1])
files = [f for f in out.rglob("*") if f.is_file()]
problems = [f"{len(files)} files come back, more than the 8 the machine returns"] if len(files) > 8 else []
problems += [f"{f.name}: {f.stat().st_size / 2**20:.1f} MiB, over 16 MiB" for f in files if f.stat().st_size > 16 * 2**20]
md = (out / "gpu_check.md").read_text()
problems += [] if "random init" in md else ["gpu_check.md never says random init"]
names = {Path(n).name for n in tarfile.open(out / "gpu_results.tar.gz").getnames()}
want = ["tests-smoke.txt", "store_check-smoke.json", "mfu-smoke.md", "split_sweep-smoke.md", "checkpointing-smoke.md",
        "vs_trl-smoke.md", "memory_knobs-smoke.md", "vs_trl_dpo-smoke.md", "fsdp-smoke.md", "tradeoffs-smoke.md"]
problems += [f"gpu_results.tar.gz lacks {w}" for w in want if w not in names]
for p in problems:
    print(f"gpu_rehearsal: {p}")
sys.exit(1 if problems else 0)
EOF
echo "gpu_rehearsal: passed in $(($(date +%s) - T0)) s (wheels $(du -sh .gpu-wheels | cut -f1)); results in $RH/out"
