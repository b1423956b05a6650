"""Rotary position embedding in place (contract: `kernels.reference.rotary`): one program per token,
rotating its query heads and then its key heads."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import next_pow2


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, pos_ptr, stride_qt, stride_qh, stride_kt, stride_kh,
                   stride_cos, num_q_heads, num_k_heads, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                   BLOCK_HALF: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    j = tl.arange(0, BLOCK_HALF)
    jmask = j < HALF
    c = tl.load(cos_ptr + pos * stride_cos + j, mask=jmask, other=0.0).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + pos * stride_cos + j, mask=jmask, other=0.0).to(tl.float32)[None, :]
    h = tl.arange(0, BLOCK_H)
    # q heads
    for h0 in range(0, num_q_heads, BLOCK_H):
        hh = h0 + h
        m = (hh < num_q_heads)[:, None] & jmask[None, :]
        p = q_ptr + t * stride_qt + hh[:, None] * stride_qh + j[None, :]
        x1 = tl.load(p, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(p + HALF, mask=m, other=0.0).to(tl.float32)
        tl.store(p, (x1 * c - x2 * s).to(q_ptr.dtype.element_ty), mask=m)
        tl.store(p + HALF, (x2 * c + x1 * s).to(q_ptr.dtype.element_ty), mask=m)
    for h0 in range(0, num_k_heads, BLOCK_H):
        hh = h0 + h
        m = (hh < num_k_heads)[:, None] & jmask[None, :]
        p = k_ptr + t * stride_kt + hh[:, None] * stride_kh + j[None, :]
        x1 = tl.load(p, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(p + HALF, mask=m, other=0.0).to(tl.float32)
        tl.store(p, (x1 * c - x2 * s).to(k_ptr.dtype.element_ty), mask=m)
        tl.store(p + HALF, (x2 * c + x1 * s).to(k_ptr.dtype.element_ty), mask=m)


def rotary_inplace_triton(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          positions: torch.Tensor) -> None:
    assert q.stride(-1) == 1 and k.stride(-1) == 1, "rotary_inplace needs unit stride on head_dim"
    assert cos.stride(-1) == 1 and sin.stride(-1) == 1 and cos.stride(0) == sin.stride(0)
    t, hq, d = q.shape
    hk = k.shape[1]
    if t == 0:
        return
    half = d // 2
    block_h = min(16, next_pow2(max(hq, hk)))
    _rotary_kernel[(t,)](q, k, cos, sin, positions, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                         cos.stride(0), hq, hk, HALF=half, BLOCK_H=block_h, BLOCK_HALF=next_pow2(half),
                         num_warps=4)
