"""The one place that picks an implementation per op: Triton kernels on CUDA, torch references elsewhere."""

from __future__ import annotations

import torch

from .paged_attention import AttentionMetadata, paged_attention_ref


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    return paged_attention_ref(q, k, v, k_cache, v_cache, meta)
