"""Attention over a paged KV cache for one step: write this step's K/V, then attend.

Sequences are ordered decodes first (one query token each), then prefill/extend chunks; a chunk
attends causally to itself and to everything already cached for its sequence (prefix-cache hits and
earlier chunks), which is what chunked prefill and prefix caching need.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..metadata import AttentionMetadata
from .kv_cache import write_kv_ref

DecodeAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


def paged_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, meta: AttentionMetadata,
                        decode: DecodeAttention | None = None) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, Hkv, D] (this step's new tokens). Writes k/v into the cache, returns [T, H, D].
    `decode(q_decodes, k_cache, v_cache, meta)`: another implementation of the decode rows' part (the
    native CPU one, kernels/cpu); the prefill chunks always take the code here."""
    write_kv_ref(k, v, k_cache, v_cache, meta.slot_mapping)
    out = torch.empty_like(q)
    nd = meta.num_decodes
    if nd and decode is not None:
        out[:nd] = decode(q[:nd], k_cache, v_cache, meta)
    elif nd:
        blocks, mask = meta.decode_gather()
        # index_select over whole blocks as rows: one memcpy per block (2-3x faster than advanced indexing).
        rows = (-1, meta.block_size * k_cache[0].numel())
        gathered = (blocks.shape[0], -1, *k_cache.shape[1:])
        flat = blocks.reshape(-1)
        kk = k_cache.view(rows).index_select(0, flat).view(gathered).transpose(1, 2)  # [Nd, Hkv, L, D]
        vv = v_cache.view(rows).index_select(0, flat).view(gathered).transpose(1, 2)
        # In the cache's dtype: converting the gathered K/V would cost more than the attention itself
        # (a bf16 cache: bf16 inputs, fp32 accumulation inside the kernel).
        qq = q[:nd].unsqueeze(2).to(k_cache.dtype)  # [Nd, H, 1, D]
        out[:nd] = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, enable_gqa=True).squeeze(2)
    start = nd
    for s in range(nd, len(meta.query_lens_host)):
        qlen, ctx = meta.query_lens_host[s], meta.seq_lens_host[s]
        qs = q[start:start + qlen].transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
        if ctx == qlen:  # nothing cached before this chunk: attend to the new keys directly
            ks, vs = k[start:start + qlen], v[start:start + qlen]
            o = F.scaled_dot_product_attention(qs, ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0),
                                               is_causal=True, enable_gqa=True)
        else:
            idx = meta.context_slots(s)
            ks, vs = k_cache[idx].to(q.dtype), v_cache[idx].to(q.dtype)
            qpos = torch.arange(ctx - qlen, ctx, device=q.device)
            mask = torch.arange(ctx, device=q.device)[None, :] <= qpos[:, None]
            o = F.scaled_dot_product_attention(qs, ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0),
                                               attn_mask=mask, enable_gqa=True)
        out[start:start + qlen] = o.squeeze(0).transpose(0, 1)
        start += qlen
    return out
