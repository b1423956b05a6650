"""Rotary position embedding applied in place to q and k.

Rotate-half layout (Hugging Face Llama): for x = [x1, x2] split at head_dim / 2,
rope(x) = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]. `cos`/`sin` are the full tables
`[max_positions, head_dim // 2]` (fp32) and `positions` `[T]` picks each token's row; q `[T, H, D]`
and k `[T, Hkv, D]` may be strided views (e.g. slices of a fused QKV output) with unit stride on D.
"""

from __future__ import annotations

import torch


def apply_rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The engine's math: x [tokens, heads, head_dim]; cos/sin [tokens, head_dim // 2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def rotary_inplace_ref(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       positions: torch.Tensor) -> None:
    c, s = cos[positions], sin[positions]
    q.copy_(apply_rope_ref(q, c, s))
    k.copy_(apply_rope_ref(k, c, s))
