"""The encoder's linear layers: the plain path is linear, GELU and a residual addition as torch computes
them; the oneDNN path (packed weight, fused epilogues) gives the same values wherever `onednn_fusion`
picks it (bf16; float32 on AVX-512), and is never picked off a CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.embedding.linear import Linear, onednn_fusion


@pytest.fixture
def data():
    g = torch.Generator().manual_seed(1)
    return (torch.randn(37, 48, generator=g), torch.randn(80, 48, generator=g) * 0.1, torch.randn(80, generator=g),
            torch.randn(37, 80, generator=g))


def test_the_plain_path(data):
    x, w, b, res = data
    lin = Linear(w, b, torch.float32, fused=False)
    torch.testing.assert_close(lin(x), F.linear(x, w, b))
    torch.testing.assert_close(lin.gelu(x, "tanh"), F.gelu(F.linear(x, w, b), approximate="tanh"))
    torch.testing.assert_close(lin.plus(x, res), res + F.linear(x, w, b))


def test_fusion_only_on_a_cpu_and_float32_only_on_avx512(monkeypatch):
    assert not onednn_fusion(torch.bfloat16, torch.device("cuda"))
    assert not onednn_fusion(torch.float16, torch.device("cpu"))
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert not onednn_fusion(torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_fused_path_agrees_with_the_plain_one(data, dtype):
    if not onednn_fusion(dtype, torch.device("cpu")):
        pytest.skip(f"oneDNN's fused linear is not used for {dtype} on this machine")
    x, w, b, res = (t.to(dtype) for t in data)
    plain, fused = Linear(w, b, dtype, fused=False), Linear(w, b, dtype, fused=True, rows=64)
    for approximate in ("none", "tanh"):
        torch.testing.assert_close(fused.gelu(x, approximate).float(), plain.gelu(x, approximate).float(),
                                   atol=0.02, rtol=0.02)
    torch.testing.assert_close(fused(x).float(), plain(x).float(), atol=0.02, rtol=0.02)
    torch.testing.assert_close(fused.plus(x, res).float(), plain.plus(x, res).float(), atol=0.03, rtol=0.02)
    assert fused(x[:5]).shape == (5, 80)  # other step sizes than the packing's
