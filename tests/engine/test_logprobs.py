"""Logprobs: exact (full-precision) log-softmax values for the returned tokens, aligned with token_ids."""

from __future__ import annotations

import pytest
import torch

from engine import EngineRequest, SamplingParams
from engine.weights import Linear

pytestmark = pytest.mark.model


def run(engine, prompt, **sampling):
    res = engine.generate([EngineRequest("lp", prompt, SamplingParams(**sampling))])["lp"]
    ids = [t for o in res for t in o.token_ids]
    lps = [lp for o in res for lp in (o.logprobs or [])]
    return ids, lps


def check_against_full_logits(engine, prompt, ids, lps, k):
    assert len(lps) == len(ids)
    full = engine.prompt_logits(prompt + ids)[len(prompt) - 1:].float().log_softmax(-1)  # row i predicts ids[i]
    for i, (t, lp) in enumerate(zip(ids, lps)):
        want = full[i].topk(k)
        assert lp.token_id == t == lp.top_ids[0]  # greedy: the sampled token is the argmax
        assert len(lp.top_ids) == len(lp.top_logprobs) == k
        torch.testing.assert_close(torch.tensor(lp.top_logprobs), want.values, rtol=0, atol=1e-4)
        assert lp.logprob == pytest.approx(float(full[i, t]), abs=1e-4)
        # the same tokens, up to the order of exact ties
        assert {j for j, v in zip(want.indices.tolist(), want.values.tolist()) if v > want.values[-1] + 1e-4} \
            <= set(lp.top_ids)


def test_greedy_top5_equal_log_softmax_of_full_precision_logits(engine, tokenizer):
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Name three rivers."}])
    ids, lps = run(engine, prompt, temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)
    check_against_full_logits(engine, prompt, ids, lps, 5)


def test_bf16_output_layer_still_gives_exact_logprobs(torch_engine, tokenizer):
    """With the torch path's bf16 output layer only each row's top candidates are exact; rows that want
    logprobs are recomputed in full precision."""
    engine = torch_engine
    model = engine.runner.model
    assert model.lm_head_fast is None  # the fixture's fp32 engine: install the bf16 layer for this test
    model.lm_head_fast = Linear(model.lm_head.weight, None, torch.bfloat16)
    try:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is a river?"}])
        ids, lps = run(engine, prompt, temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)
        check_against_full_logits(engine, prompt, ids, lps, 5)  # prompt_logits: exact output layer
        h = torch.randn(1, model.lm_head.weight.shape[1])
        assert (model.logits(h) - model.logits(h, exact=True)).abs().max() > 1e-3  # bf16 alone is not exact
    finally:
        model.lm_head_fast = None


def test_logprobs_follow_temperature_and_only_rows_that_ask_get_them(engine, tokenizer):
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Say something."}])
    reqs = [EngineRequest("a", prompt, SamplingParams(temperature=0.7, seed=3, max_tokens=6, logprobs=0)),
            EngineRequest("b", prompt, SamplingParams(temperature=0.7, seed=3, max_tokens=6))]
    res = engine.generate(reqs)
    assert all(o.logprobs is None for o in res["b"])
    ids = [t for o in res["a"] for t in o.token_ids]
    lps = [lp for o in res["a"] for lp in o.logprobs or []]
    assert [t for o in res["b"] for t in o.token_ids] == ids  # asking for logprobs changes nothing else
    full = engine.prompt_logits(prompt + ids)[len(prompt) - 1:]
    for i, lp in enumerate(lps):
        assert lp.top_ids == [] and lp.token_id == ids[i]
        assert lp.logprob == pytest.approx(float((full[i] / 0.7).log_softmax(-1)[ids[i]]), abs=1e-4)
