#!/usr/bin/env bash
# Installs LiteLLM's proxy in its own environment, for bench/remote_overhead.py only (the comparison).
# It is never a dependency of Sluice.
set -euo pipefail
ENV_DIR="${1:-bench/.venv-litellm}"
if [ ! -x "$ENV_DIR/bin/python" ]; then python3 -m venv "$ENV_DIR"; fi
"$ENV_DIR/bin/python" -m pip install -q --upgrade pip
"$ENV_DIR/bin/python" -m pip install -q 'litellm[proxy]'
"$ENV_DIR/bin/litellm" --version || true
