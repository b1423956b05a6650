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


def _rope_(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> None:
    """`x.copy_(apply_rope_ref(x, ...))` in six ops and no temporaries of x's full size (the same
    products and sums, so the same values): a decode step calls this once per layer."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    x1_s, x2_s = x1 * s, x2 * s
    x1.mul_(c).sub_(x2_s)
    x2.mul_(c).add_(x1_s)


def _adjacent(q: torch.Tensor, k: torch.Tensor) -> bool:
    """k's heads directly follow q's in memory with the same strides (a fused QKV output)."""
    return (q.dim() == k.dim() == 3 and q.shape[0] == k.shape[0] and q.shape[2] == k.shape[2]
            and q.stride() == k.stride() and q.dtype == k.dtype
            and k.data_ptr() == q.data_ptr() + q.shape[1] * q.stride(1) * q.element_size())


def rotary_inplace_ref(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       positions: torch.Tensor) -> None:
    c, s = cos[positions].unsqueeze(1).to(q.dtype), sin[positions].unsqueeze(1).to(q.dtype)
    if _adjacent(q, k):  # one pass over q and k together
        _rope_(q.as_strided((q.shape[0], q.shape[1] + k.shape[1], q.shape[2]), q.stride()), c, s)
    else:
        _rope_(q, c, s)
        _rope_(k, c.to(k.dtype), s.to(k.dtype))
