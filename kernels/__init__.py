"""Compute kernels: leaves of the dependency tree. Each op has a torch reference (`kernels.reference`) and a
Triton kernel (`kernels.triton`); `kernels.dispatch` picks one per call (Triton on CUDA).

Importing this package never imports Triton and works without Triton installed.
"""

from .dispatch import fused_add_rms_norm, paged_attention, rms_norm, rotary_inplace, silu_and_mul, write_kv
from .metadata import AttentionMetadata
from .sampling import sample_tokens

__all__ = ["AttentionMetadata", "fused_add_rms_norm", "paged_attention", "rms_norm", "rotary_inplace",
           "sample_tokens", "silu_and_mul", "write_kv"]
