# voiced: the two commands a newcomer needs are `make run` and `make test`.
# Each creates its own virtual environment (.venv) first.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The PyTorch build to install. On a GPU machine the default PyPI wheel is the CUDA build.
TORCH ?= torch==2.13.0
ARGS ?=
# Where `make run` opens the HTTP door: the web page, OpenAI's audio API and Realtime (empty: off).
HTTP ?= 127.0.0.1:8080

.PHONY: run test test-gpu proto lint system-deps venv clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# Installed once per change of pyproject.toml: the daemon for `run`, plus the references for `test`.
$(VENV)/.run-installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet "$(TORCH)"
	$(BIN)/pip install --quiet -e ".[torch]"
	touch $@

$(VENV)/.test-installed: $(VENV)/.run-installed client/pyproject.toml
	$(BIN)/pip install --quiet -e ".[torch,dev]"
	touch $@

venv: $(VENV)/.run-installed

# espeak-ng and sox make real speech for the tests; haproxy fronts two daemons in the scale-out test;
# Debian's chromium runs the web page's test.
system-deps:
	@if ! command -v espeak-ng >/dev/null || ! command -v sox >/dev/null || ! command -v haproxy >/dev/null; then \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq espeak-ng sox haproxy >/dev/null; \
	fi
	@if ! command -v chromium >/dev/null; then \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get install -y -qq chromium >/dev/null 2>&1 || ($$SUDO apt-get update -qq && \
		$$SUDO apt-get install -y -qq chromium >/dev/null) || \
		echo "chromium could not be installed: the web page's browser test will be skipped"; \
	fi

run: $(VENV)/.run-installed
	@$(if $(HTTP),echo "voiced: open http://$(HTTP)/ in a browser (OpenAI-compatible API: http://$(HTTP)/v1)",true)
	$(BIN)/voiced serve $(if $(HTTP),--http $(HTTP)) $(ARGS)

test: system-deps $(VENV)/.test-installed
	$(BIN)/python -m pytest -q $(ARGS)

# On a machine with a CUDA GPU: the GPU tests (skipped elsewhere).
test-gpu: system-deps $(VENV)/.test-installed
	$(BIN)/python -m pytest -q -m gpu $(ARGS)

proto: $(VENV)/.test-installed
	$(BIN)/python proto/generate.py

lint: $(VENV)/.test-installed
	$(BIN)/ruff check voiced client tests

clean:
	rm -rf $(VENV) .pytest_cache
