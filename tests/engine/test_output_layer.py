"""The bf16 output layer with exact recomputation of each row's top candidates."""

import torch

from engine.model import REFINE_TOP, Linear, LlamaModel


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
