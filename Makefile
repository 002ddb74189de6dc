# onegpu: the README's two commands are `make run` and `make test`.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
# Extra requirement installed before the project, e.g. TORCH=torch==2.13.0 for a CPU-only machine
# (.ci/run does this). Empty: pip picks torch from pyproject's range (a CUDA build on Linux x86-64).
TORCH  ?=
export PATH := $(CURDIR)/$(BIN):$(PATH)

.PHONY: install run test test-quick clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(if $(TORCH),$(BIN)/python -m pip install --quiet "$(TORCH)")
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@

run: install
	$(BIN)/dvc repro

test: install
	$(BIN)/python -m pytest

test-quick: install
	$(BIN)/python -m pytest -m "not slow"

clean:
	rm -rf $(VENV) mlflow.db mlartifacts .onegpu data/processed data/stats.json models metrics plots
