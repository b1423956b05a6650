"""One request that makes a step fail must not fail the other requests of that step."""

from __future__ import annotations

import pytest

from engine.request import EngineRequest, RequestRejected, SamplingParams

pytestmark = pytest.mark.model


def _greedy(rid: str, prompt: list[int], max_tokens: int = 12) -> EngineRequest:
    return EngineRequest(rid, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))


def test_out_of_range_sampling_fields_are_rejected_at_add(engine):
    for sp in (SamplingParams(temperature=1.0, top_k=2**63), SamplingParams(seed=2**70),
               SamplingParams(stop_token_ids=[engine.tokenizer.vocab_size + 5])):
        with pytest.raises(RequestRejected):
            engine.add_request(EngineRequest("bad", [1, 2, 3], sp))
    assert not engine.has_unfinished()


def test_a_request_that_breaks_the_step_fails_alone(engine, tokenizer):
    prompt = tokenizer.encode("The quick brown fox jumps over the lazy dog. Then it")
    alone = engine.generate([_greedy("alone", prompt)])["alone"]
    expected = [t for o in alone for t in o.token_ids]

    engine.add_request(_greedy("good", prompt))
    engine.add_request(EngineRequest("evil", prompt, SamplingParams(temperature=0.8, top_k=5, max_tokens=12)))
    # What validation refuses at the edge, smuggled past it: a top_k that overflows int64 in the sampler.
    engine._seqs["evil"].sampling.top_k = 2**63
    outs: dict[str, list] = {"good": [], "evil": []}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id].append(o)
    assert outs["evil"][-1].finished and outs["evil"][-1].finish_reason == "error"
    assert "other requests were not affected" in outs["evil"][-1].error
    assert [t for o in outs["good"] for t in o.token_ids] == expected
    assert outs["good"][-1].finish_reason == "length"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
