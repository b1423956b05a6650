"""Prefill/extend attention over a paged KV cache (contract: `kernels.reference.extend_attention`).

Triton grid: (sequences, query heads, query tiles of BLOCK_M); K/V are gathered through the block
table tile by tile and the causal bound stops each tile at its last query's position.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .common import dot_in_f32, dot_precision, next_pow2


@triton.jit
def _extend_kernel(q_ptr, kc_ptr, vc_ptr, out_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, scale, first_seq,
                   stride_qt, stride_qh, stride_ot, stride_oh, stride_ks, stride_kh, stride_vs, stride_vh,
                   stride_bt, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr, DOT_PREC: tl.constexpr,
                   DOT_F32: tl.constexpr):
    s = first_seq + tl.program_id(0)
    h = tl.program_id(1)
    tile = tl.program_id(2)
    q_start = tl.load(qsl_ptr + s)
    qlen = tl.load(qsl_ptr + s + 1) - q_start
    if tile * BLOCK_M < qlen:
        seq_len = tl.load(seq_lens_ptr + s)
        prefix = seq_len - qlen
        kvh = h // GROUP
        i = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        imask = i < qlen
        qpos = prefix + i
        d = tl.arange(0, BLOCK_D)
        dmask = d < HEAD_DIM
        rows = (q_start + i).to(tl.int64)
        q = tl.load(q_ptr + rows[:, None] * stride_qt + h * stride_qh + d[None, :],
                    mask=imask[:, None] & dmask[None, :], other=0.0)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        hi = tl.minimum(seq_len, prefix + (tile + 1) * BLOCK_M)  # causal bound of the tile's last query
        offs_n = tl.arange(0, BLOCK_N)
        for n0 in range(0, hi, BLOCK_N):
            n = n0 + offs_n
            nmask = n < hi
            blk = tl.load(bt_ptr + s.to(tl.int64) * stride_bt + n // PAGE, mask=nmask, other=0)
            slot = blk.to(tl.int64) * PAGE + n % PAGE
            kv_mask = nmask[:, None] & dmask[None, :]
            k = tl.load(kc_ptr + slot[:, None] * stride_ks + kvh * stride_kh + d[None, :], mask=kv_mask, other=0.0)
            if DOT_F32:  # the interpreter's bf16 tl.dot is wrong: same rounding of the inputs, fp32 product
                qk = tl.dot(q.to(tl.float32), tl.trans(k.to(q.dtype).to(tl.float32)), input_precision="ieee")
            else:
                qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PREC)
            qk = qk * scale
            # rows past qlen have qpos >= seq_len > every n here, so they stay finite (and are not stored)
            qk = tl.where(nmask[None, :] & (n[None, :] <= qpos[:, None]), qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(vc_ptr + slot[:, None] * stride_vs + kvh * stride_vh + d[None, :], mask=kv_mask, other=0.0)
            if DOT_F32:
                pv = tl.dot(p.to(q.dtype).to(tl.float32), v.to(q.dtype).to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PREC)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        o = acc / l_i[:, None]
        tl.store(out_ptr + rows[:, None] * stride_ot + h * stride_oh + d[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=imask[:, None] & dmask[None, :])


def extend_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                            block_size: int, max_query_len: int, first_seq: int = 0, scale: float | None = None,
                            out: torch.Tensor | None = None, block_m: int | None = None,
                            block_n: int | None = None) -> torch.Tensor:
    """Fills rows of `out` ([T, H, D]) for sequences first_seq..; `max_query_len` is host-side (grid size)."""
    t, h, d = q.shape
    hkv = k_cache.shape[1]
    assert h % hkv == 0 and q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    out = torch.empty_like(q) if out is None else out
    num_seqs = seq_lens.shape[0] - first_seq
    if num_seqs <= 0 or max_query_len <= 0:
        return out
    block_d = next_pow2(d)
    if block_m is None:
        block_m = (64 if d <= 64 else 32) if q.is_cuda else 16
    if block_n is None:
        block_n = (64 if d <= 64 else 32) if q.is_cuda else 16
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    grid = (num_seqs, h, (max_query_len + block_m - 1) // block_m)
    _extend_kernel[grid](
        q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc, float(scale), first_seq,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), block_tables.stride(0), GROUP=h // hkv, HEAD_DIM=d,
        BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n, PAGE=block_size, DOT_PREC=dot_precision(q.dtype),
        DOT_F32=dot_in_f32(q.dtype), num_warps=4)
    return out
