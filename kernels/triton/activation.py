"""SiLU-and-multiply (contract: `kernels.reference.activation`): one program per row and column block."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import cdiv, next_pow2


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, n_cols, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(gate_up: torch.Tensor, block: int | None = None) -> torch.Tensor:
    shape = gate_up.shape
    x = gate_up.reshape(-1, shape[-1])
    if x.stride(-1) != 1:
        x = x.contiguous()
    n_rows, n = x.shape
    inter = n // 2
    out = torch.empty((n_rows, inter), dtype=gate_up.dtype, device=gate_up.device)
    if n_rows:
        block = block or min(1024, next_pow2(inter))
        _silu_and_mul_kernel[(n_rows, cdiv(inter, block))](
            x, out, inter, x.stride(0), out.stride(0), BLOCK=block, num_warps=4)
    return out.view(*shape[:-1], inter)
