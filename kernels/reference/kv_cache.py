"""Writing this step's K/V into their cache slots.

Cache of one layer: `[num_slots, kv_heads, head_dim]`, slot = block * block_size + offset.
`slot_mapping[t]` is token t's slot. k, v `[T, Hkv, D]` may be strided views of a fused QKV output.
"""

from __future__ import annotations

import torch


def write_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    k_cache.index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.index_copy_(0, slot_mapping, v.to(v_cache.dtype))
