"""The one place that picks an implementation per op: Triton kernels on CUDA, torch references elsewhere.

Rule (see `_triton.use_triton`): `SLUICE_KERNELS=auto` (default) runs Triton when the tensors are on
CUDA and Triton imports, else the torch reference; `torch` / `triton` force one. The torch branches are
exactly the engine's CPU math, so switching the engine to these calls changes nothing on CPU.
"""

from __future__ import annotations

import torch

from ._triton import use_triton
from .activation import silu_and_mul_ref, silu_and_mul_triton
from .kv_cache import write_kv_ref, write_kv_triton
from .paged_attention import AttentionMetadata, paged_attention_ref, paged_attention_triton
from .rms_norm import fused_add_rms_norm_ref, fused_add_rms_norm_triton
from .rotary import rotary_inplace_ref, rotary_inplace_triton


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """Writes this step's k/v into the layer's cache, then attends; q [T, H, D], k/v [T, Hkv, D]."""
    if use_triton(q):
        return paged_attention_triton(q, k, v, k_cache, v_cache, meta)
    return paged_attention_ref(q, k, v, k_cache, v_cache, meta)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x); residual None: (rms_norm(x), x)."""
    if use_triton(x):
        return fused_add_rms_norm_triton(x, residual, weight, eps)
    return fused_add_rms_norm_ref(x, residual, weight, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return fused_add_rms_norm(x, None, weight, eps)[0]


def rotary_inplace(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   positions: torch.Tensor) -> None:
    """Rotate-half RoPE in place on q [T, H, D] and k [T, Hkv, D]; cos/sin are the full [max_pos, D/2] tables."""
    if use_triton(q):
        rotary_inplace_triton(q, k, cos, sin, positions)
    else:
        rotary_inplace_ref(q, k, cos, sin, positions)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [..., 2 * I] (gate first)."""
    if use_triton(gate_up):
        return silu_and_mul_triton(gate_up)
    return silu_and_mul_ref(gate_up)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k/v [T, Hkv, D] into cache slots (the Triton kernel skips negative slots: padding rows)."""
    if use_triton(k):
        write_kv_triton(k, v, k_cache, v_cache, slot_mapping)
    else:
        write_kv_ref(k, v, k_cache, v_cache, slot_mapping)
