"""Attention over a paged KV cache for one step (contract: `kernels.reference.paged_attention`): the
write_kv kernel, then the decode kernel on the decodes and the extend kernel on the prefill chunks."""

from __future__ import annotations

import torch

from ..metadata import AttentionMetadata
from .decode_attention import decode_attention_triton
from .extend_attention import extend_attention_triton
from .kv_cache import write_kv_triton


def paged_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                           v_cache: torch.Tensor, meta: AttentionMetadata,
                           num_splits: int | None = None) -> torch.Tensor:
    """Same contract as `paged_attention_ref`: write_kv kernel, then the decode kernel on the first
    num_decodes sequences and the extend kernel on the rest. No host synchronisation: the only host
    values read are the metadata's host-side lists."""
    write_kv_triton(k, v, k_cache, v_cache, meta.slot_mapping)
    out = torch.empty_like(q)
    nd = meta.num_decodes
    if nd:
        decode_attention_triton(q[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens[:nd],
                                meta.block_size, out=out[:nd], num_splits=num_splits, max_len=meta.max_decode_len)
    if len(meta.query_lens_host) > nd:
        extend_attention_triton(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                meta.block_size, max(meta.query_lens_host[nd:]), first_seq=nd, out=out)
    return out
