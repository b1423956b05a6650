"""The bf16 output layer with exact recomputation of each row's top candidates."""

import pytest
import torch

from engine.model import REFINE_TOP, Int4Weight, Linear, LlamaModel, int4_available


def test_fast_logits_are_exact_where_it_matters():
    torch.manual_seed(0)
    weight = torch.randn(5000, 64)
    model = LlamaModel.__new__(LlamaModel)  # only the output layer is needed
    model.lm_head = Linear(weight, None, torch.float32)
    model.lm_head_fast = Linear(weight, None, torch.bfloat16)
    h = torch.randn(32, 64)
    exact = model.logits(h, exact=True)
    fast = model.logits(h)
    bf16_only = model.lm_head_fast(h).float()
    assert torch.equal(fast.argmax(-1), exact.argmax(-1))  # greedy decisions are exact
    refined = bf16_only.topk(REFINE_TOP, dim=-1).indices  # the candidates recomputed at full precision
    torch.testing.assert_close(fast.gather(1, refined), exact.gather(1, refined), rtol=1e-5, atol=1e-4)
    assert (bf16_only - exact).abs().max() > 1e-3  # without the refinement the values really differ
    assert (fast - exact).abs().max() < 0.5  # and the rest stay close (bf16 rounding of the tail)


@pytest.mark.skipif(not int4_available(torch.device("cpu")), reason="no CPU int4 matmul in this torch")
def test_int4_weight_computes_the_gguf_blocks():
    """Int4Weight multiplies by code * scale + min of each group of 32 (GGUF Q4_1), in bf16 arithmetic."""
    torch.manual_seed(0)
    n, k = 96, 128
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    scale = torch.rand(n, k // 32) * 0.01
    mn = -torch.rand(n, k // 32) * 0.05
    dense = (codes.float().reshape(n, k // 32, 32) * scale[..., None] + mn[..., None]).reshape(n, k)
    w4 = Int4Weight((codes, scale, mn))
    lin = Linear(dense, None, torch.bfloat16, int4=w4)
    x = torch.randn(5, k)
    ref = x @ dense.T
    lin.int4_max_rows = 8
    torch.testing.assert_close(lin(x), ref, rtol=2e-2, atol=2e-2)  # the int4 path (5 rows <= 8)
    lin.int4_max_rows = 4
    torch.testing.assert_close(lin(x), ref, rtol=2e-2, atol=2e-2)  # the bf16 path above it
