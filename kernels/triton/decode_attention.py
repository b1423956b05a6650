"""Paged decode attention (contract: `kernels.reference.decode_attention`): one query token per
sequence, K/V read through block tables.

Grouped-query attention with any ratio of query to KV heads, variable context lengths in one launch,
fp16/bf16/fp32 inputs with fp32 accumulation. The Triton path is split-KV ("flash decoding"): grid
(sequences, kv_heads, splits); each program loads the whole query-head group of one KV head (padded
to 16 rows so `tl.dot` runs on tensor cores), walks its share of the context in tiles of BLOCK_N
tokens (gathering slots through the block table, so tiles may cross cache blocks), and writes a
partial (max, sum, acc); a second kernel merges the splits. The grid depends only on the batch size
and the split count, never on the context lengths, so a CUDA graph captured once replays for any
lengths.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .common import dot_in_f32, dot_precision, next_pow2, num_sms


@triton.jit
def _decode_kernel(q_ptr, kc_ptr, vc_ptr, bt_ptr, seq_lens_ptr, po_ptr, pm_ptr, pl_ptr, scale,
                   stride_qs, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_bt,
                   GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_N: tl.constexpr, PAGE: tl.constexpr, NUM_SPLITS: tl.constexpr,
                   DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr):
    s = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    num_heads = tl.num_programs(1) * GROUP
    seq_len = tl.load(seq_lens_ptr + s)
    chunk = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, seq_len)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    gmask = g < GROUP
    dmask = d < HEAD_DIM
    heads = kvh * GROUP + g
    q = tl.load(q_ptr + s.to(tl.int64) * stride_qs + heads[:, None] * stride_qh + d[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + offs_n
        nmask = n < end
        blk = tl.load(bt_ptr + s.to(tl.int64) * stride_bt + n // PAGE, mask=nmask, other=0)
        slot = blk.to(tl.int64) * PAGE + n % PAGE
        kv_mask = nmask[:, None] & dmask[None, :]
        k = tl.load(kc_ptr + slot[:, None] * stride_ks + kvh * stride_kh + d[None, :], mask=kv_mask, other=0.0)
        if DOT_F32:  # the interpreter's bf16 tl.dot is wrong: same rounding of the inputs, fp32 product
            qk = tl.dot(q.to(tl.float32), tl.trans(k.to(q.dtype).to(tl.float32)), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PREC)
        qk = qk * scale  # [BLOCK_G, BLOCK_N] fp32
        qk = tl.where(nmask[None, :], qk, float("-inf"))
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
    # partials: po [S, H, NUM_SPLITS, BLOCK_D], pm/pl [S, H, NUM_SPLITS]
    row = (s.to(tl.int64) * num_heads + heads) * NUM_SPLITS + split
    tl.store(pm_ptr + row, m_i, mask=gmask)
    tl.store(pl_ptr + row, l_i, mask=gmask)
    tl.store(po_ptr + row[:, None] * BLOCK_D + d[None, :], acc, mask=gmask[:, None])


@triton.jit
def _merge_kernel(po_ptr, pm_ptr, pl_ptr, out_ptr, stride_os, stride_oh, HEAD_DIM: tl.constexpr,
                  BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_SPLITS: tl.constexpr):
    s = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    num_heads = tl.num_programs(1)
    sp = tl.arange(0, BLOCK_SPLITS)
    d = tl.arange(0, BLOCK_D)
    smask = sp < NUM_SPLITS
    row = (s * num_heads + h) * NUM_SPLITS + sp
    m = tl.load(pm_ptr + row, mask=smask, other=float("-inf"))
    lsum = tl.load(pl_ptr + row, mask=smask, other=0.0)
    acc = tl.load(po_ptr + row[:, None] * BLOCK_D + d[None, :], mask=smask[:, None], other=0.0)
    m_max = tl.max(m, 0)
    w = tl.where(m > float("-inf"), tl.exp(m - m_max), 0.0)
    total = tl.sum(w * lsum, 0)
    o = tl.sum(acc * w[:, None], 0) / total
    tl.store(out_ptr + s * stride_os + h * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def default_num_splits(num_seqs: int, num_kv_heads: int, max_len: int, device: torch.device,
                       block_n: int) -> int:
    """Enough programs to fill the GPU (about 2 per SM), never more splits than tiles of context."""
    if device.type != "cuda":
        return 1 if max_len <= 2 * block_n else 2
    want = max(1, math.ceil(2 * num_sms(device.index or 0) / max(1, num_seqs * num_kv_heads)))
    if max_len > 0:
        want = min(want, max(1, math.ceil(max_len / block_n)))
    return min(32, next_pow2(want))


def decode_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                            out: torch.Tensor | None = None, scale: float | None = None,
                            num_splits: int | None = None, max_len: int = 0, block_n: int | None = None,
                            ) -> torch.Tensor:
    """q [S, H, D] (unit stride on D); caches [slots, Hkv, D]; returns/fills out [S, H, D].

    `num_splits`: fixed split count (pass one per CUDA-graph bucket); default from the batch shape and
    `max_len` (host-side longest context, 0 if unknown).
    """
    s_count, h, d = q.shape
    hkv = k_cache.shape[1]
    assert h % hkv == 0, f"{h} query heads is not a multiple of {hkv} kv heads"
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    if out is None:
        out = torch.empty_like(q)
    if s_count == 0:
        return out
    group = h // hkv
    block_d = next_pow2(d)
    block_n = block_n or (64 if d <= 128 else 32)
    splits = num_splits or default_num_splits(s_count, hkv, max_len, q.device, block_n)
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    part_o = torch.empty((s_count, h, splits, block_d), dtype=torch.float32, device=q.device)
    part_m = torch.empty((s_count, h, splits), dtype=torch.float32, device=q.device)
    part_l = torch.empty((s_count, h, splits), dtype=torch.float32, device=q.device)
    _decode_kernel[(s_count, hkv, splits)](
        q, k_cache, v_cache, block_tables, seq_lens, part_o, part_m, part_l, float(scale),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        block_tables.stride(0), GROUP=group, BLOCK_G=max(16, next_pow2(group)), HEAD_DIM=d, BLOCK_D=block_d,
        BLOCK_N=block_n, PAGE=block_size, NUM_SPLITS=splits, DOT_PREC=dot_precision(q.dtype),
        DOT_F32=dot_in_f32(q.dtype), num_warps=4)
    _merge_kernel[(s_count, h)](
        part_o, part_m, part_l, out, out.stride(0), out.stride(1), HEAD_DIM=d, BLOCK_D=block_d,
        NUM_SPLITS=splits, BLOCK_SPLITS=max(2, next_pow2(splits)), num_warps=4)
    return out
