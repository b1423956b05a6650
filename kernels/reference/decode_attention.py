"""Paged decode attention: one query token per sequence, K/V read through block tables.

Grouped-query attention with any ratio of query to KV heads, variable context lengths in one call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                         seq_lens: torch.Tensor, block_size: int, scale: float | None = None) -> torch.Tensor:
    """q [S, H, D]; caches [slots, Hkv, D]; block_tables [S, max_blocks]; seq_lens [S]. Returns [S, H, D].

    Straightforward per-sequence reference (host loop), independent of `paged_attention_ref`'s batching.
    """
    out = torch.empty_like(q)
    s_count, h, d = q.shape
    hkv = k_cache.shape[1]
    for s in range(s_count):
        n = int(seq_lens[s])
        pos = torch.arange(n, device=q.device)
        slots = block_tables[s, pos // block_size].long() * block_size + pos % block_size
        k = k_cache[slots].float().repeat_interleave(h // hkv, dim=1)  # [n, H, D]
        v = v_cache[slots].float().repeat_interleave(h // hkv, dim=1)
        o = F.scaled_dot_product_attention(q[s].float()[:, None, :], k.transpose(0, 1), v.transpose(0, 1),
                                           scale=scale)
        out[s] = o[:, 0, :].to(q.dtype)
    return out
