"""Runs llama-cpp-python's OpenAI server with llama.cpp's weight repacking off (`--no-repack` of the C++
server): on CPUs with AMX the repacked path crashes the process on the first request. Runs in
bench/.venv-llamacpp (imports nothing of Sluice); arguments are the server's own."""

import runpy

import llama_cpp.llama_cpp as lib

_default_params = lib.llama_model_default_params


def _no_repack():  # type: ignore[no-untyped-def]
    params = _default_params()
    params.use_extra_bufts = False
    return params


lib.llama_model_default_params = _no_repack
runpy.run_module("llama_cpp.server", run_name="__main__")
