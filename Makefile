# onegpu: the README's two commands are `make run` and `make test`.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
# Extra requirement installed before the project, e.g. TORCH=torch==2.13.0 for a CPU-only machine
# (.ci/run does this). Empty: pip picks torch from pyproject's range (a CUDA build on Linux x86-64).
TORCH  ?=
export PATH := $(CURDIR)/$(BIN):$(PATH)

.PHONY: install run test test-quick lock clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml requirements.lock
	$(PYTHON) -m venv $(VENV)
	$(if $(TORCH),$(BIN)/python -m pip install --quiet "$(TORCH)")
	$(BIN)/python -m pip install --quiet -c requirements.lock -e '.[dev]'
	touch $@

run: install
	$(BIN)/dvc repro

test: install
	$(BIN)/python -m pytest

test-quick: install
	$(BIN)/python -m pytest -m "not slow"

# Re-pin requirements.lock to what the venv has now (torch stays unpinned: it is per machine).
lock: install
	{ echo "# Versions this project was tested with (pip constraints: make install applies them)."; \
	  echo "# torch is left to the machine: a CUDA build on GPU machines, torch==2.13.0 (CPU) in CI."; \
	  echo "# Regenerate: make lock"; \
	  $(BIN)/python -m pip freeze --exclude-editable | grep -vE '^(torch|triton|nvidia-[a-z0-9-]+-cu[0-9]+|onegpu)[=@ ]'; \
	} > requirements.lock

clean:
	rm -rf $(VENV) mlflow.db mlartifacts .onegpu data/processed data/stats.json models metrics plots
