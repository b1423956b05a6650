#!/usr/bin/env bash
# Builds llama-cpp-python's OpenAI-compatible server in its own environment, for bench/vs_llamacpp.py only.
# It is never a runtime dependency of Sluice. PyPI ships it as source, so this compiles llama.cpp (minutes).
set -euo pipefail
ENV_DIR="${1:-bench/.venv-llamacpp}"
if [ ! -x "$ENV_DIR/bin/python" ]; then python3 -m venv "$ENV_DIR"; fi
"$ENV_DIR/bin/python" -m pip install -q --upgrade pip
CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}" "$ENV_DIR/bin/python" -m pip install -q 'llama-cpp-python[server]'
"$ENV_DIR/bin/python" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"
