#!/usr/bin/env bash
# Downloads, here (where PyPI is reachable), the wheels `bench/gpu.sh` needs on the lent GPU machine, which
# has no network: its python3 (3.12) already holds torch (CUDA), triton, aiohttp, numpy, tokenizers,
# safetensors and jinja2, but not gguf, pydantic, pydantic-settings, redis, openai, tenacity,
# llguidance or orjson. The run carries the folder (`run` with carry=["bench/.gpu-wheels"]) and gpu.sh
# installs from it with `pip install --no-index --target`, never touching the machine's own packages.
#
#   bash bench/gpu_wheels.sh                 # cp312 manylinux wheels into bench/.gpu-wheels
#   PY_VERSION=3.11 OUT=/tmp/w bash bench/gpu_wheels.sh   # another Python (the offline check here)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-bench/.gpu-wheels}"
PY_VERSION="${PY_VERSION:-3.12}"
PKGS=(gguf "pydantic>=2.6" "pydantic-settings>=2.3" "redis>=5.0" "openai>=3.57" "tenacity>=8.2"
      "llguidance>=1.9,<2" orjson "prometheus-client>=0.20" rich)
mkdir -p "$OUT"
python3 -m pip download -q --only-binary=:all: --python-version "$PY_VERSION" \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64 \
  --platform any -d "$OUT" "${PKGS[@]}" --no-deps
# Their own dependencies, except what the GPU image already has (torch stack, numpy, aiohttp, ...).
python3 -m pip download -q --only-binary=:all: --python-version "$PY_VERSION" \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64 \
  --platform any -d "$OUT" pydantic-core annotated-types typing-inspection python-dotenv jiter distro \
  httpx2 sniffio anyio typing-extensions pyyaml tqdm sentencepiece 2>/dev/null || true
ls "$OUT" | wc -l | xargs echo "wheels in $OUT:"
# The default model's package (98 MB) is over what a run may carry: its tokenizer goes instead, and gpu.sh
# makes random weights of its shape there (bench/random_gguf.py).
mkdir -p bench/.gpu-model
python3 -m bench.random_gguf --tokenizer-only --out bench/.gpu-model/tokenizer.gguf 2>/dev/null \
  || .venv/bin/python -m bench.random_gguf --tokenizer-only --out bench/.gpu-model/tokenizer.gguf
