# voiced: the two commands a newcomer needs are `make run` and `make test`.
# Each creates its own virtual environment (.venv) first.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The PyTorch build to install. On a GPU machine the default PyPI wheel is the CUDA build.
TORCH ?= torch==2.13.0
ARGS ?=
# The pip extra the daemon is installed with (pyproject.toml): everything `voiced serve`, `speak`,
# `transcribe` and `voices add` import. tests/test_dependencies.py reads this line.
RUN_EXTRA := torch

.PHONY: run test test-quick test-slow test-gpu proto lint system-deps venv clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# Installed once per change of pyproject.toml: the daemon for `run`, plus the references for `test`.
$(VENV)/.run-installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet "$(TORCH)"
	$(BIN)/pip install --quiet -e ".[$(RUN_EXTRA)]"
	touch $@

$(VENV)/.test-installed: $(VENV)/.run-installed client/pyproject.toml
	$(BIN)/pip install --quiet -e ".[$(RUN_EXTRA),dev]"
	touch $@

venv: $(VENV)/.run-installed

# espeak-ng and sox make real speech for the tests.
system-deps:
	@if ! command -v espeak-ng >/dev/null || ! command -v sox >/dev/null; then \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq espeak-ng sox >/dev/null; \
	fi

run: $(VENV)/.run-installed
	$(BIN)/voiced serve $(ARGS)

# Every test CI needs, the slow ones included (about 4 minutes on 2 cores).
test: system-deps $(VENV)/.test-installed
	$(BIN)/python -m pytest -q $(ARGS)

# While editing: everything but the tests marked `slow` (each takes 5 s or more on 2 cores) ...
test-quick: system-deps $(VENV)/.test-installed
	$(BIN)/python -m pytest -q -m "not slow" $(ARGS)

# ... and those alone.
test-slow: system-deps $(VENV)/.test-installed
	$(BIN)/python -m pytest -q -m slow $(ARGS)

# On a machine with a CUDA GPU: the GPU tests (skipped elsewhere).
test-gpu: system-deps $(VENV)/.test-installed
	$(BIN)/python -m pytest -q -m gpu $(ARGS)

proto: $(VENV)/.test-installed
	$(BIN)/python proto/generate.py

lint: $(VENV)/.test-installed
	$(BIN)/ruff check voiced client tests

clean:
	rm -rf $(VENV) .pytest_cache
