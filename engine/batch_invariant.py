"""Batch-invariant linear layers and attention for `EngineConfig.deterministic`.

A BLAS matmul picks its blocking, its kernels and its split of the reduction across threads from the
shapes it is given, so one token's row of `x @ W.T` can round differently when the batch around it has
another number of rows (on this project's CPU build even fp32 differs in the last bit for batches of
1-8 rows against 300, and the bf16 output rounding turns such bits into visible differences). The
engine batches a token with whatever else runs in that step, and a prefix-cache hit changes how many
prompt tokens a prefill computes, so by default the same greedy request can pick another token when a
near-tie is decided by that last bit.

Here every reduction a token goes through has shapes that depend only on that token:

* linear layers run in fixed chunks of `CHUNK` rows (the last chunk padded with zeros), so every BLAS
  call has the same shape whatever the batch is;
* attention runs one query token at a time over exactly the keys it may see: a token at position p
  always computes [heads, 1, p + 1] scores and a [p + 1]-long weighted sum, whether it is part of a cold
  prefill, a prefill after a cache hit, a later chunk, or a decode step beside other sequences.

Elementwise ops and the row-wise norms, RoPE and SiLU are already per-token. The cost is speed
(padding for small batches, one attention call per token per layer), which is why it is opt-in.
"""

from __future__ import annotations

import math

import torch

from kernels import AttentionMetadata, write_kv

CHUNK = 16  # rows per matmul call: padding a lone decode to 16 rows costs less than more calls per prefill


def linear(x: torch.Tensor, weight: torch.Tensor, multiply_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x @ weight.T computed in fixed-shape chunks of CHUNK rows (x: [M, K], weight: [N, K]).
    `multiply_dtype`: both converted to it first (float32 for bf16 weights on a CPU without bf16 units,
    where the emulated bf16 matmul is ~5x slower; the weight is converted once per call, not kept)."""
    if multiply_dtype is not None and multiply_dtype != weight.dtype:
        x, weight = x.to(multiply_dtype), weight.to(multiply_dtype)
    m = x.shape[0]
    pad = -m % CHUNK
    if pad:
        x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
    out = torch.empty(m + pad, weight.shape[0], dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    for i in range(0, m + pad, CHUNK):
        torch.mm(x[i:i + CHUNK], weight.t(), out=out[i:i + CHUNK])
    return out[:m]


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """Same contract as `kernels.paged_attention` (writes this step's k/v, returns [T, H, D]), one query
    token at a time so that each token's result depends only on its own position and context."""
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    # Scaling q first is elementwise, so it is per-token too.
    qs = (q * (1.0 / math.sqrt(head_dim))).reshape(num_tokens, num_kv_heads, group, head_dim)
    out = torch.empty(num_tokens, num_kv_heads, group, head_dim, dtype=q.dtype, device=q.device)
    # Thousands of tiny ops: on a CPU, waking the intra-op thread pool for each costs more than the op
    # (10x in all on a 2-core box), so the loop runs on this thread alone.
    threads = torch.get_num_threads()
    if q.device.type == "cpu" and threads > 1:
        torch.set_num_threads(1)
    try:
        _attend(qs, k_cache, v_cache, meta, out)
    finally:
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
    return out.view(num_tokens, num_heads, head_dim)


def _attend(qs: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
            out: torch.Tensor) -> None:
    start = 0
    for s, (qlen, ctx) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host)):
        idx = meta.context_slots(s)
        # [Hkv, ctx, D], contiguous: every slice below has the same row stride whatever ctx is.
        keys = k_cache[idx].to(qs.dtype).transpose(0, 1).contiguous()
        values = v_cache[idx].to(qs.dtype).transpose(0, 1).contiguous()
        for j in range(start, start + qlen):
            n = ctx - (start + qlen - j) + 1  # this token and everything before it
            scores = torch.bmm(qs[j], keys[:, :n].transpose(1, 2))  # [Hkv, g, n]
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(qs.dtype)
            torch.bmm(probs, values[:, :n], out=out[j])
        start += qlen
