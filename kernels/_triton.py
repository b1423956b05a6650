"""Triton availability and the dispatch rule, shared by every kernel module.

Triton is optional: a CPU serving install does not have it, so nothing here imports it eagerly and
`import kernels` works without it. Kernel bodies are plain functions turned into Triton kernels on
first use (`jit`), so `TRITON_INTERPRET` is read when a kernel is first launched, not when `kernels`
is imported (the test suite imports the engine, and so `kernels`, long before the interpreter tests
set it).

Dispatch: `SLUICE_KERNELS=auto` (default) picks Triton for CUDA tensors when Triton imports and the
torch reference otherwise; `SLUICE_KERNELS=torch` always takes the reference; `SLUICE_KERNELS=triton`
always takes Triton (on CPU tensors that only works under `TRITON_INTERPRET=1`).
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

# Triton is imported only when a kernel is first launched: its own library functions (tl.cdiv,
# tl.max, ...) are built as interpreted or compiled functions when `triton` is imported, so the
# interpreter tests must be able to set TRITON_INTERPRET before that happens. A serving CPU install
# has no Triton at all; the torch references cover everything there.
HAS_TRITON = importlib.util.find_spec("triton") is not None


def interpret_mode() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def kernel_mode() -> str:
    mode = os.environ.get("SLUICE_KERNELS", "auto").lower()
    if mode not in ("auto", "torch", "triton"):
        raise ValueError(f"SLUICE_KERNELS must be auto, torch or triton, got {mode!r}")
    return mode


def use_triton(t: torch.Tensor) -> bool:
    """True when the op on tensor `t` should run its Triton kernel."""
    mode = kernel_mode()
    if mode == "torch":
        return False
    if mode == "triton":
        if not HAS_TRITON:
            raise RuntimeError("SLUICE_KERNELS=triton but triton is not installed (pip install -e '.[kernels]')")
        return True
    return HAS_TRITON and t.is_cuda


@functools.cache
def _jit_cached(fn, interpret: bool):
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed (pip install -e '.[kernels]')")
    import triton
    import triton.language

    # Kernel bodies are plain functions in their op's module and name `tl` as a module global
    # (a placeholder until now, so that the module imports without Triton).
    fn.__globals__["tl"] = triton.language
    return triton.jit(fn)


def jit(fn):
    """The Triton kernel for plain function `fn` (built once per interpreter setting)."""
    return _jit_cached(fn, interpret_mode())


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get a true fp32 dot (no TF32) so the fp32 path matches the reference closely."""
    return "ieee" if dtype == torch.float32 else "tf32"


@functools.cache
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def dot_in_f32(dtype: torch.dtype) -> bool:
    """Under the interpreter, `tl.dot` on bf16 returns garbage (numpy has no bf16): the kernels then round
    their dot inputs to bf16 exactly as on the GPU and multiply in fp32. Never on a real GPU."""
    return dtype == torch.bfloat16 and interpret_mode()
