"""RMSNorm fused with the residual add (contract: `kernels.reference.rms_norm`): one program per row."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import next_pow2


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_cols, stride_x, stride_r, stride_o,
                     stride_ro, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        h = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # rounded like torch's residual + x
        tl.store(res_out_ptr + row * stride_ro + cols, h, mask=mask)
    else:
        h = x
    h32 = h.to(tl.float32)
    var = tl.sum(h32 * h32, axis=0) / n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = h32 * (1.0 / tl.sqrt(var + eps)) * w
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def fused_add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                              eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    n_rows, n_cols = x2.shape
    out = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    if residual is not None:
        r2 = residual.reshape(-1, shape[-1])
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
        res_out = torch.empty_like(out)
    else:
        r2, res_out = x2, out  # unused
    if n_rows:
        block = next_pow2(n_cols)
        _rms_norm_kernel[(n_rows,)](
            x2, r2, weight, out, res_out, n_cols, x2.stride(0), r2.stride(0), out.stride(0), res_out.stride(0),
            float(eps), HAS_RES=residual is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)))
    if residual is None:
        return out.view(shape), x
    return out.view(shape), res_out.view(shape)
