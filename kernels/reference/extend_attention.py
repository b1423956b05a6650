"""Prefill/extend attention over a paged KV cache: a chunk of new tokens attends causally to itself
and to its sequence's cached prefix (prefix-cache hits, earlier chunks of a chunked prefill).

The new tokens' K/V must already be in the cache (`write_kv` first). Sequence s's query tokens are
`q[query_start_loc[s]:query_start_loc[s+1]]`; its context is `seq_lens[s]` tokens, the last
`query_len` of which are the new ones, so query i sits at position `seq_len - query_len + i`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def extend_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                         seq_lens: torch.Tensor, query_start_loc: torch.Tensor, block_size: int,
                         first_seq: int = 0, scale: float | None = None, out: torch.Tensor | None = None,
                         ) -> torch.Tensor:
    """q [T, H, D]. Fills rows of `out` for sequences first_seq.. (per-sequence host loop)."""
    out = torch.empty_like(q) if out is None else out
    h = q.shape[1]
    hkv = k_cache.shape[1]
    for s in range(first_seq, len(seq_lens)):
        a, b = int(query_start_loc[s]), int(query_start_loc[s + 1])
        n, qlen = int(seq_lens[s]), b - a
        pos = torch.arange(n, device=q.device)
        slots = block_tables[s, pos // block_size].long() * block_size + pos % block_size
        k = k_cache[slots].float().repeat_interleave(h // hkv, dim=1).transpose(0, 1)  # [H, n, D]
        v = v_cache[slots].float().repeat_interleave(h // hkv, dim=1).transpose(0, 1)
        qpos = torch.arange(n - qlen, n, device=q.device)
        mask = pos[None, :] <= qpos[:, None]
        o = F.scaled_dot_product_attention(q[a:b].float().transpose(0, 1), k, v, attn_mask=mask, scale=scale)
        out[a:b] = o.transpose(0, 1).to(q.dtype)
    return out
