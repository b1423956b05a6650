"""Fused add+RMSNorm, in-place RoPE, SiLU-and-mul and the K/V cache write (Triton, interpreted) against
the references."""

import pytest
import torch

pytest.importorskip("triton")

from kernels.reference.activation import silu_and_mul_ref
from kernels.reference.kv_cache import write_kv_ref
from kernels.reference.rms_norm import fused_add_rms_norm_ref
from kernels.reference.rotary import rotary_inplace_ref
from kernels.triton.activation import silu_and_mul_triton
from kernels.triton.kv_cache import write_kv_triton
from kernels.triton.rms_norm import fused_add_rms_norm_triton
from kernels.triton.rotary import rotary_inplace_triton

from ..conftest import DEV, DTYPES, close

pytestmark = pytest.mark.triton


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden,with_residual", [(64, True), (96, True), (128, False)])
def test_fused_add_rms_norm(dtype, hidden, with_residual):
    torch.manual_seed(hidden)
    x = torch.randn(5, hidden).to(dtype).to(DEV)
    res = torch.randn(5, hidden).to(dtype).to(DEV) if with_residual else None
    w = (1 + 0.1 * torch.randn(hidden)).to(dtype).to(DEV)
    normed, new_res = fused_add_rms_norm_triton(x, res, w, 1e-5)
    ref_normed, ref_res = fused_add_rms_norm_ref(x, res, w, 1e-5)
    close(new_res, ref_res, dtype)
    close(normed, ref_normed, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("h,hkv,d", [(4, 4, 64), (8, 2, 128), (32, 4, 64)])
def test_rotary_inplace_on_qkv_views(dtype, h, hkv, d):
    """q and k are strided views of one fused QKV output, rotated in place; v is left alone."""
    torch.manual_seed(d + h)
    t = 6
    qkv = torch.randn(t, (h + 2 * hkv) * d).to(dtype).to(DEV)
    positions = torch.tensor([0, 1, 15, 16, 17, 99], device=DEV)
    ang = torch.arange(100, dtype=torch.float64)[:, None] / (10000 ** (torch.arange(0, d, 2) / d))[None, :]
    cos, sin = ang.cos().float().to(DEV), ang.sin().float().to(DEV)
    ref = qkv.clone()

    def views(m):
        return m[:, :h * d].view(t, h, d), m[:, h * d:(h + hkv) * d].view(t, hkv, d)

    rotary_inplace_triton(*views(qkv), cos, sin, positions)
    rotary_inplace_ref(*views(ref), cos, sin, positions)
    close(qkv[:, :(h + hkv) * d], ref[:, :(h + hkv) * d], dtype)
    assert torch.equal(qkv[:, (h + hkv) * d:], ref[:, (h + hkv) * d:])


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    torch.manual_seed(2)
    gate_up = (3 * torch.randn(2, 3, 2 * 40)).to(dtype).to(DEV)  # 40 columns in blocks of 16: a ragged last block
    close(silu_and_mul_triton(gate_up, block=16), silu_and_mul_ref(gate_up), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_strided_and_padding(dtype):
    """k/v as views of a QKV output; slot -1 (a padding row of a graph bucket) writes nothing."""
    torch.manual_seed(4)
    t, hkv, d = 5, 2, 64
    qkv = torch.randn(t, (4 + 2 * hkv) * d).to(dtype).to(DEV)
    k = qkv[:, 4 * d:(4 + hkv) * d].view(t, hkv, d)
    v = qkv[:, (4 + hkv) * d:].view(t, hkv, d)
    slots = torch.tensor([3, 16, -1, 17, 40], device=DEV)
    kc, vc = torch.zeros(48, hkv, d, dtype=dtype, device=DEV), torch.zeros(48, hkv, d, dtype=dtype, device=DEV)
    kc2, vc2 = kc.clone(), vc.clone()
    write_kv_triton(k, v, kc, vc, slots)
    keep = slots >= 0
    write_kv_ref(k[keep], v[keep], kc2, vc2, slots[keep])
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
