"""The dispatch point: torch references on CPU (identical to the engine's math), Triton when forced,
and `import kernels` without Triton installed."""

import subprocess
import sys

import pytest
import torch

import kernels
from kernels import dispatch
from kernels.reference.paged_attention import paged_attention_ref


def test_import_without_triton():
    code = ("import sys; sys.modules['triton'] = None; import kernels, torch; "
            "x = torch.randn(2, 8); print(kernels.rms_norm(x, torch.ones(8), 1e-5).shape)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "torch.Size([2, 8])" in out.stdout


def rms_norm(x, weight, eps):
    """The textbook formulas, written out independently of kernels/."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * weight.float()).to(x.dtype)


def apply_rope(x, cos, sin):
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def test_torch_branches_match_the_reference_math_exactly(monkeypatch):
    monkeypatch.delenv("SLUICE_KERNELS", raising=False)

    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        h, x, w = torch.randn(4, 64).to(dtype), torch.randn(4, 64).to(dtype), torch.randn(64).to(dtype)
        normed, res = kernels.fused_add_rms_norm(x, h, w, 1e-5)
        assert torch.equal(res, h + x) and torch.equal(normed, rms_norm(h + x, w, 1e-5))
        assert torch.equal(kernels.rms_norm(x, w, 1e-5), rms_norm(x, w, 1e-5))
        gate_up = torch.randn(4, 2 * 32).to(dtype)
        gate, up = gate_up.chunk(2, dim=-1)
        assert torch.equal(kernels.silu_and_mul(gate_up), torch.nn.functional.silu(gate) * up)
        qkv = torch.randn(3, 8 * 16).to(dtype)
        q, k = qkv[:, :64].view(3, 4, 16), qkv[:, 64:96].view(3, 2, 16)
        cos, sin = torch.randn(10, 8), torch.randn(10, 8)
        pos = torch.tensor([0, 4, 9])
        eq, ek = apply_rope(q, cos[pos], sin[pos]), apply_rope(k, cos[pos], sin[pos])
        kernels.rotary_inplace(q, k, cos, sin, pos)
        assert torch.equal(q, eq) and torch.equal(k, ek)


def test_cpu_defaults_to_torch_and_env_forces(monkeypatch):
    x = torch.randn(2, 2)
    monkeypatch.delenv("SLUICE_KERNELS", raising=False)
    assert not dispatch.use_triton(x)
    monkeypatch.setenv("SLUICE_KERNELS", "torch")
    assert not dispatch.use_triton(x)
    monkeypatch.setenv("SLUICE_KERNELS", "bogus")
    with pytest.raises(ValueError):
        dispatch.use_triton(x)


@pytest.mark.triton
def test_forced_triton_runs_the_kernels(monkeypatch):
    """SLUICE_KERNELS=triton sends CPU tensors to the Triton path (interpreted here)."""
    pytest.importorskip("triton")
    from .conftest import DEV

    monkeypatch.setenv("SLUICE_KERNELS", "triton")
    calls = []
    from kernels.triton import paged_attention as triton_paged_attention

    real = triton_paged_attention.paged_attention_triton
    monkeypatch.setattr(triton_paged_attention, "paged_attention_triton",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    bs, hkv, d = 4, 2, 64
    meta = kernels.AttentionMetadata(
        slot_mapping=torch.tensor([5, 8, 9, 10], device=DEV),
        block_tables=torch.tensor([[1, 0], [2, 0]], dtype=torch.int32, device=DEV),
        seq_lens=torch.tensor([2, 3], dtype=torch.int32, device=DEV),
        query_start_loc=torch.tensor([0, 1, 4], dtype=torch.int32, device=DEV),
        num_decodes=1, block_size=bs, query_lens_host=[1, 3], seq_lens_host=[2, 3], max_decode_len=2)
    q, k, v = torch.randn(4, 4, d, device=DEV), torch.randn(4, hkv, d, device=DEV), torch.randn(4, hkv, d, device=DEV)
    kc, vc = torch.randn(16, hkv, d, device=DEV), torch.randn(16, hkv, d, device=DEV)
    kc2, vc2 = kc.clone(), vc.clone()
    out = kernels.paged_attention(q, k, v, kc, vc, meta)
    assert calls == [1]
    torch.testing.assert_close(out, paged_attention_ref(q, k, v, kc2, vc2, meta), atol=2e-5, rtol=2e-5)
    normed, res = kernels.fused_add_rms_norm(q[:, 0], k[:, 0], torch.ones(d, device=DEV), 1e-5)
    torch.testing.assert_close(res, q[:, 0] + k[:, 0])


def test_rotary_reference_rotates_q_and_k_of_a_fused_qkv_in_one_pass_with_the_same_values():
    """q and k that are adjacent slices of one QKV output are rotated together; the values equal the
    plain formula bit for bit, and v (after k) is untouched."""
    from kernels.reference.rotary import apply_rope_ref, rotary_inplace_ref

    torch.manual_seed(0)
    ang = torch.randn(64, 16)
    cos, sin = ang.cos(), ang.sin()
    pos = torch.tensor([0, 5, 63])
    qkv = torch.randn(3, 4 * 32 + 2 * 2 * 32)
    q, k = qkv[:, :128].unflatten(-1, (4, 32)), qkv[:, 128:192].unflatten(-1, (2, 32))
    want_q, want_k = apply_rope_ref(q, cos[pos], sin[pos]), apply_rope_ref(k, cos[pos], sin[pos])
    v = qkv[:, 192:].clone()
    rotary_inplace_ref(q, k, cos, sin, pos)
    assert torch.equal(q, want_q) and torch.equal(k, want_k) and torch.equal(qkv[:, 192:], v)
    k2 = torch.randn(3, 2, 32)  # not adjacent: rotated on its own
    want_k2 = apply_rope_ref(k2, cos[pos], sin[pos])
    q2 = torch.randn(3, 4, 32)
    want_q2 = apply_rope_ref(q2, cos[pos], sin[pos])
    rotary_inplace_ref(q2, k2, cos, sin, pos)
    assert torch.equal(q2, want_q2) and torch.equal(k2, want_k2)


def test_native_cpu_code_runs_only_in_auto_mode(monkeypatch):
    """The engine's native CPU kernels follow SLUICE_KERNELS like every op: `torch` and `triton` turn them off."""
    monkeypatch.setattr(dispatch.cpu, "available", lambda: True)
    monkeypatch.delenv("SLUICE_KERNELS", raising=False)
    assert dispatch.native_cpu_allowed()
    for mode in ("torch", "triton"):
        monkeypatch.setenv("SLUICE_KERNELS", mode)
        assert not dispatch.native_cpu_allowed()
    monkeypatch.delenv("SLUICE_KERNELS")
    monkeypatch.setattr(dispatch.cpu, "available", lambda: False)  # no C compiler: the torch path
    assert not dispatch.native_cpu_allowed()
