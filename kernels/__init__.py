"""Compute kernels: leaves of the dependency tree. Each op has a torch reference; `dispatch` picks Triton on CUDA.

Importing this package never imports Triton's kernels eagerly and works without Triton installed.
"""

from .dispatch import fused_add_rms_norm, paged_attention, rms_norm, rotary_inplace, silu_and_mul, write_kv
from .paged_attention import AttentionMetadata
from .sampling import sample_tokens

__all__ = ["AttentionMetadata", "fused_add_rms_norm", "paged_attention", "rms_norm", "rotary_inplace",
           "sample_tokens", "silu_and_mul", "write_kv"]
