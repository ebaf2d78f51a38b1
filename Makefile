# voiced: the two commands a newcomer needs are `make run` and `make test`.
# Each creates its own virtual environment (.venv) first.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The PyTorch build to install. On a GPU machine the default PyPI wheel is the CUDA build.
TORCH ?= torch==2.13.0
ARGS ?=

.PHONY: run test test-gpu proto lint system-deps venv clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# Installed once per change of pyproject.toml.
$(VENV)/.installed: $(BIN)/python pyproject.toml client/pyproject.toml
	$(BIN)/pip install --quiet "$(TORCH)"
	$(BIN)/pip install --quiet -e ".[torch,dev]"
	touch $@

venv: $(VENV)/.installed

# espeak-ng and sox make real speech for the tests.
system-deps:
	@if ! command -v espeak-ng >/dev/null || ! command -v sox >/dev/null; then \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq espeak-ng sox >/dev/null; \
	fi

run: venv
	$(BIN)/voiced serve $(ARGS)

test: system-deps venv
	$(BIN)/python -m pytest -q $(ARGS)

# On a machine with a CUDA GPU: the GPU tests (skipped elsewhere).
test-gpu: venv
	$(BIN)/python -m pytest -q -m gpu $(ARGS)

proto: venv
	$(BIN)/python proto/generate.py

lint: venv
	$(BIN)/ruff check voiced client tests

clean:
	rm -rf $(VENV) .pytest_cache
