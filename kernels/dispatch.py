"""The one place that picks an implementation per op: Triton kernels on CUDA, torch references elsewhere.

Rule: `SLUICE_KERNELS=auto` (default) runs Triton when the tensors are on CUDA and Triton is installed,
else the torch reference (on a CPU with a bf16 KV cache, the decode rows' attention runs natively,
kernels/cpu, built at first use with the machine's C compiler); `SLUICE_KERNELS=torch` always takes the
reference; `SLUICE_KERNELS=triton` always takes Triton (on CPU tensors that only works under
`TRITON_INTERPRET=1`). The torch branches are exactly the engine's CPU math.

The engine's whole-step native kernels (the CPU forward step, its int8 output layer, sampling) are not
per-op choices: the engine asks `native_cpu_allowed` once at start, under the same rule (only `auto`
runs native code), and keeps the answer (engine/cpu_plan.py, `CpuKernels`).

Triton is optional: a CPU serving install does not have it. An op's Triton module (`kernels.triton.*`)
is imported the first time that op takes the Triton branch, never when `kernels` is imported, so
`import kernels` works without Triton and `TRITON_INTERPRET` can still be set after it.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from . import cpu
from .metadata import AttentionMetadata
from .reference.activation import silu_and_mul_ref
from .reference.kv_cache import write_kv_ref
from .reference.paged_attention import paged_attention_ref
from .reference.rms_norm import fused_add_rms_norm_ref
from .reference.rotary import rotary_inplace_ref

HAS_TRITON = importlib.util.find_spec("triton") is not None


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


def native_cpu_allowed() -> bool:
    """Whether native CPU code (kernels/cpu) may run: `auto` mode, and a C compiler built it here."""
    return kernel_mode() == "auto" and cpu.available()


def use_native_cpu(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """The native CPU decode attention (kernels/cpu): fp32 queries on a CPU, a bf16 cache, and native
    code allowed (`native_cpu_allowed`)."""
    return (q.device.type == "cpu" and q.dtype == torch.float32 and k_cache.dtype == torch.bfloat16
            and native_cpu_allowed())


def _native_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   meta: AttentionMetadata) -> torch.Tensor:
    nd = meta.num_decodes
    return cpu.decode_attention(q, k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens[:nd], meta.block_size,
                                torch.get_num_threads())


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """Writes this step's k/v into the layer's cache, then attends; q [T, H, D], k/v [T, Hkv, D]."""
    if use_triton(q):
        from .triton.paged_attention import paged_attention_triton

        return paged_attention_triton(q, k, v, k_cache, v_cache, meta)
    decode = _native_decode if meta.num_decodes and use_native_cpu(q, k_cache) else None
    return paged_attention_ref(q, k, v, k_cache, v_cache, meta, decode)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x); residual None: (rms_norm(x), x)."""
    if use_triton(x):
        from .triton.rms_norm import fused_add_rms_norm_triton

        return fused_add_rms_norm_triton(x, residual, weight, eps)
    return fused_add_rms_norm_ref(x, residual, weight, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return fused_add_rms_norm(x, None, weight, eps)[0]


def rotary_inplace(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   positions: torch.Tensor) -> None:
    """Rotate-half RoPE in place on q [T, H, D] and k [T, Hkv, D]; cos/sin are the full [max_pos, D/2] tables."""
    if use_triton(q):
        from .triton.rotary import rotary_inplace_triton

        rotary_inplace_triton(q, k, cos, sin, positions)
    else:
        rotary_inplace_ref(q, k, cos, sin, positions)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [..., 2 * I] (gate first)."""
    if use_triton(gate_up):
        from .triton.activation import silu_and_mul_triton

        return silu_and_mul_triton(gate_up)
    return silu_and_mul_ref(gate_up)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k/v [T, Hkv, D] into cache slots (the Triton kernel skips negative slots: padding rows)."""
    if use_triton(k):
        from .triton.kv_cache import write_kv_triton

        write_kv_triton(k, v, k_cache, v_cache, slot_mapping)
    else:
        write_kv_ref(k, v, k_cache, v_cache, slot_mapping)
