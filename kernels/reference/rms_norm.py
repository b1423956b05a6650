"""RMSNorm fused with the residual add.

`fused_add_rms_norm(x, residual, weight, eps)` returns `(rms_norm(residual + x), residual + x)`;
with `residual=None` it is a plain RMSNorm and the second result is `x`. Statistics in fp32, the
sum rounded to the activation dtype before normalising (what the engine's
`h = h + out; rms_norm(h)` does).
"""

from __future__ import annotations

import torch


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * weight.float()).to(x.dtype)


def fused_add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    h = x if residual is None else residual + x
    return rms_norm_ref(h, weight, eps), h
