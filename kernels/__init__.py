"""Compute kernels: leaves of the dependency tree. Each op has a torch reference; `dispatch` picks Triton on CUDA."""

from .dispatch import paged_attention
from .paged_attention import AttentionMetadata

__all__ = ["AttentionMetadata", "paged_attention"]
