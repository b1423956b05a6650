"""Penalties, logit_bias and min_tokens: exactly OpenAI's (and vLLM's) formulas, per row, and on a real model.

The property tests build sequences with random histories and check `logits_controls` +
`apply_logits_controls` (the path both samplers take) against the documented formulas written out
naively; the model tests check the effects end to end.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import EngineRequest, RequestOutput, RequestRejected, SamplingParams
from engine.request import Guide, TokenLogprob
from engine.sampler import logits_controls
from engine.sequence import Sequence
from kernels.sampling import apply_logits_controls

VOCAB = 24
EOS = 0

tokens = st.integers(0, VOCAB - 1)
penalty = st.floats(-2, 2, allow_nan=False)


def make_seq(sp: SamplingParams, prompt: list[int], generated: list[int], incremental: bool) -> Sequence:
    """Generated tokens either resumed (counted at creation) or appended one by one (the scheduler's way)."""
    req = EngineRequest("r", prompt, sp, resume_token_ids=[] if incremental else generated)
    seq = Sequence.from_request(req, max_tokens=10**6, eos_token_ids=[EOS])
    for t in generated if incremental else []:
        seq.append_output(t)
    return seq


def processed(seqs: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
    c = logits_controls(seqs, logits.device, None)
    return logits if c is None else apply_logits_controls(logits, c)


rows = st.tuples(penalty, penalty, st.dictionaries(tokens, st.floats(-100, 100, allow_nan=False), max_size=4),
                 st.lists(tokens, max_size=6), st.lists(tokens, max_size=12), st.booleans())


@settings(max_examples=40, deadline=None)
@given(st.lists(rows, min_size=1, max_size=4), st.integers(0, 2**31))
def test_frequency_presence_and_bias_are_openais_formula(batch, seed):
    g = torch.Generator().manual_seed(seed)
    logits = 5 * torch.randn(len(batch), VOCAB, generator=g)
    seqs = [make_seq(SamplingParams(frequency_penalty=f, presence_penalty=p, logit_bias=bias), prompt, gen, inc)
            for f, p, bias, prompt, gen, inc in batch]
    got = processed(seqs, logits)
    for i, (f, p, bias, _prompt, gen, _inc) in enumerate(batch):
        count = Counter(gen)  # generated tokens only: the prompt never counts
        for t in range(VOCAB):
            want = logits[i, t].item() + bias.get(t, 0.0) - f * count[t] - p * (count[t] > 0)
            assert got[i, t].item() == pytest.approx(want, abs=1e-4), (i, t)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.floats(0.1, 10), st.lists(tokens, min_size=1, max_size=6),
                          st.lists(tokens, max_size=8), st.booleans()), min_size=1, max_size=4),
       st.integers(0, 2**31))
def test_repetition_penalty_divides_positive_and_multiplies_negative_logits(batch, seed):
    logits = 3 * torch.randn(len(batch), VOCAB, generator=torch.Generator().manual_seed(seed))
    seqs = [make_seq(SamplingParams(repetition_penalty=r), prompt, gen, inc) for r, prompt, gen, inc in batch]
    got = processed(seqs, logits)
    for i, (r, prompt, gen, _inc) in enumerate(batch):
        for t in range(VOCAB):
            x = logits[i, t].item()
            want = (x / r if x > 0 else x * r) if t in set(prompt) | set(gen) else x
            assert got[i, t].item() == pytest.approx(want, rel=1e-6, abs=1e-6)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 6), st.integers(0, 8), st.lists(tokens, max_size=3), st.booleans())
def test_min_tokens_bans_the_stop_tokens_until_reached(min_tokens, generated, stop_ids, ignore_eos):
    sp = SamplingParams(min_tokens=min_tokens, stop_token_ids=stop_ids, ignore_eos=ignore_eos, max_tokens=20)
    seq = make_seq(sp, [1, 2], [5] * generated, incremental=True)
    got = processed([seq], torch.zeros(1, VOCAB))[0]
    banned = {t for t in range(VOCAB) if got[t] == float("-inf")}
    stops = set(stop_ids) | (set() if ignore_eos else {EOS})
    assert banned == (stops if generated < min_tokens else set())


def test_rows_without_controls_are_untouched_and_a_plain_batch_skips_the_pass():
    plain = make_seq(SamplingParams(), [1, 2, 3], [4, 4], True)
    assert logits_controls([plain, plain], torch.device("cpu"), None) is None
    logits = torch.randn(2, VOCAB)
    got = processed([plain, make_seq(SamplingParams(frequency_penalty=1.0), [1], [4, 4], True)], logits)
    assert torch.equal(got[0], logits[0]) and got[1, 4] == logits[1, 4] - 2.0


def test_validation_and_json_round_trip():
    for bad in (dict(presence_penalty=2.5), dict(frequency_penalty=-3), dict(repetition_penalty=0),
                dict(repetition_penalty=11), dict(min_tokens=-1), dict(min_tokens=50, max_tokens=10),
                dict(logit_bias={5: 101.0}), dict(logit_bias={-1: 1.0}), dict(logprobs=21), dict(logprobs=-1),
                dict(presence_penalty=float("nan")), dict(guide=Guide("xml", ""))):
        with pytest.raises(ValueError):
            SamplingParams(**bad).validate()  # type: ignore[arg-type]
    sp = SamplingParams(presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.2, min_tokens=3,
                        logit_bias={7: -100.0, 11: 2.5}, logprobs=5, guide=Guide("json_schema", '{"type": "object"}'))
    req = EngineRequest("x", [1, 2], sp, resume_token_ids=[3])
    back = EngineRequest.from_dict(json.loads(json.dumps(req.to_dict())))  # the Redis queue's trip
    assert back == req and back.sampling.logit_bias == {7: -100.0, 11: 2.5}
    assert isinstance(back.sampling.guide, Guide)
    out = RequestOutput("x", token_ids=[3], logprobs=[TokenLogprob(3, -0.25, [3, 9], [-0.25, -1.5])])
    d = json.loads(json.dumps(out.to_dict()))
    assert RequestOutput.from_dict(d) == out and RequestOutput(**d) == out


# -- the real model -----------------------------------------------------------------------------------

@pytest.mark.model
def test_logit_bias_minus_100_bans_a_likely_token(engine, tokenizer):
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Write a sentence about the sea."}])
    free = engine.generate([EngineRequest(f"free{s}", prompt, SamplingParams(temperature=1.0, seed=s, max_tokens=30,
                                                                             ignore_eos=True)) for s in range(3)])
    counts = Counter(t for outs in free.values() for o in outs for t in o.token_ids)
    token, n = counts.most_common(1)[0]
    assert n >= 3  # a token the model really uses
    biased = engine.generate([EngineRequest(f"bias{s}", prompt, SamplingParams(
        temperature=1.0, seed=s, max_tokens=30, ignore_eos=True, logit_bias={token: -100.0})) for s in range(3)])
    assert all(token not in o.token_ids for outs in biased.values() for o in outs)
    with pytest.raises(RequestRejected) as e:
        engine.add_request(EngineRequest("oov", prompt, SamplingParams(logit_bias={10**6: 1.0})))
    assert e.value.param == "logit_bias"


@pytest.mark.model
def test_min_tokens_prevents_eos_before_n(engine, tokenizer):
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Reply with just the word yes."}])
    short = engine.generate([EngineRequest("short", prompt, SamplingParams(temperature=0, max_tokens=60))])
    n = short["short"][-1].completion_tokens + 10
    assert short["short"][-1].finish_reason == "stop"  # eos comes n - 10 tokens in when nothing holds it back
    res = engine.generate([EngineRequest("long", prompt, SamplingParams(temperature=0, max_tokens=60, min_tokens=n))])
    ids = [t for o in res["long"] for t in o.token_ids]
    assert len(ids) >= n
    assert not set(ids[:n]) & set(engine.eos_token_ids)
