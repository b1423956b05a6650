#!/usr/bin/env bash
# Builds llama.cpp's own C++ `llama-server` (the server a llama.cpp user runs) and `llama-quantize` (which
# requantises the packaged GGUF to other block types) from the llama.cpp that llama-cpp-python's sdist
# vendors, for the benches and the test fixtures only. Never a runtime dependency of Sluice.
# About 25 minutes on 2 cores. Prints the server's path. On CPUs with AMX, run it with --no-repack.
set -euo pipefail
OUT="${1:-bench/.llama-server}"
BIN="$OUT/build/bin/llama-server"
if [ -x "$BIN" ] && [ -x "$OUT/build/bin/llama-quantize" ]; then echo "$BIN"; exit 0; fi
mkdir -p "$OUT"
if [ ! -d "$OUT/src" ]; then
  python3 -m pip download -q --no-deps --no-binary :all: -d "$OUT/sdist" llama-cpp-python
  mkdir -p "$OUT/src"
  tar -xzf "$OUT"/sdist/llama_cpp_python-*.tar.gz -C "$OUT/src" --strip-components=1
fi
SRC="$OUT/src/vendor/llama.cpp"
cmake -S "$SRC" -B "$OUT/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=ON \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DGGML_NATIVE=ON > "$OUT/cmake.log"
cmake --build "$OUT/build" --target llama-server llama-quantize -j "${JOBS:-2}" > "$OUT/build.log"
echo "$BIN"
