"""Writing this step's K/V into their cache slots (contract: `kernels.reference.kv_cache`): one program
per token. A negative slot skips the token (padding rows of a CUDA-graph batch bucket)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import next_pow2


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_kcs, stride_kch, stride_vcs, stride_vch, NUM_HEADS: tl.constexpr,
                     HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        i = tl.arange(0, BLOCK)
        mask = i < NUM_HEADS * HEAD_DIM
        h = i // HEAD_DIM
        d = i % HEAD_DIM
        kx = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
        vx = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
        tl.store(kc_ptr + slot * stride_kcs + h * stride_kch + d, kx.to(kc_ptr.dtype.element_ty), mask=mask)
        tl.store(vc_ptr + slot * stride_vcs + h * stride_vch + d, vx.to(vc_ptr.dtype.element_ty), mask=mask)


def write_kv_triton(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    t, hkv, d = k.shape
    if t == 0:
        return
    _write_kv_kernel[(t,)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        NUM_HEADS=hkv, HEAD_DIM=d, BLOCK=next_pow2(hkv * d), num_warps=4)
