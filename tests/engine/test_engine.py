"""End-to-end behaviour of the engine core on the real model."""

import pytest
import torch

from engine import EngineRequest, RequestRejected, SamplingParams

pytestmark = pytest.mark.model

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain photosynthesis in one sentence.",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 12?",
    "Name a famous painter.",
    "Give me a synonym for happy.",
]


def chat(engine, text):
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": text}])


def text_of(outs):
    return "".join(o.text for o in outs)


def tokens_of(outs):
    return [t for o in outs for t in o.token_ids]


def test_greedy_answer_names_paris_and_stops(engine):
    r = engine.generate([EngineRequest("p", chat(engine, PROMPTS[0]), SamplingParams(temperature=0, max_tokens=24))])
    assert "Paris" in text_of(r["p"])
    assert r["p"][-1].finish_reason == "stop"


def test_greedy_output_same_alone_and_in_batch_of_16(engine):
    target = EngineRequest("target", chat(engine, "Tell me a short story about a robot."),
                           SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    alone = tokens_of(engine.generate([target])["target"])
    others = []
    for i in range(15):
        p = PROMPTS[i % len(PROMPTS)] + " " * (i % 3) + "Answer briefly." * (i % 4)
        sp = SamplingParams(temperature=0.0 if i % 2 else 0.9, top_p=0.9, max_tokens=8 + 7 * i, seed=i)
        others.append(EngineRequest(f"o{i}", chat(engine, p), sp))
    target2 = EngineRequest("target2", target.prompt_token_ids, target.sampling)
    batch = engine.generate(others[:7] + [target2] + others[7:])
    together = tokens_of(batch["target2"])
    assert len(together) == len(alone) == 40
    if together != alone:
        # Floating-point differences between batch shapes may flip a near-tie: show that is what happened.
        k = next(i for i, (a, b) in enumerate(zip(alone, together)) if a != b)
        logits = engine.prompt_logits(target.prompt_token_ids + alone[:k])[-1]
        gap = (logits[alone[k]] - logits[together[k]]).abs().item()
        assert gap < 1e-3, f"outputs diverge at token {k} with a logit gap of {gap}: not a near-tie"


def test_seed_gives_same_output_and_different_seeds_differ(engine):
    ids = chat(engine, "Invent a name for a cat.")
    def run(rid, seed):
        sp = SamplingParams(temperature=1.0, max_tokens=20, seed=seed, ignore_eos=True)
        return tokens_of(engine.generate([EngineRequest(rid, ids, sp)])[rid])
    a, b, c = run("s1", 7), run("s2", 7), run("s3", 8)
    assert a == b
    assert a != c


def test_seeded_output_independent_of_batch(engine):
    ids = chat(engine, "Invent a name for a dog.")
    sp = SamplingParams(temperature=0.8, max_tokens=16, seed=3, ignore_eos=True)
    alone = tokens_of(engine.generate([EngineRequest("x", ids, sp)])["x"])
    reqs = [EngineRequest(f"y{i}", chat(engine, PROMPTS[i]), SamplingParams(temperature=1.0, max_tokens=10))
            for i in range(4)] + [EngineRequest("x2", ids, sp)]
    assert tokens_of(engine.generate(reqs)["x2"]) == alone


def test_stop_token_ids_and_max_tokens(engine):
    ids = chat(engine, PROMPTS[2])
    unstopped = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    free = tokens_of(engine.generate([EngineRequest("f", ids, unstopped)])["f"])
    stop_at = free[5]
    stopped = SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_at])
    r = engine.generate([EngineRequest("s", ids, stopped)])
    assert tokens_of(r["s"]) == free[:free.index(stop_at) + 1]
    assert r["s"][-1].finish_reason == "stop"
    r = engine.generate([EngineRequest("m", ids, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))])
    assert r["m"][-1].finish_reason == "length" and r["m"][-1].completion_tokens == 3


def test_new_request_joins_running_batch_at_next_step_and_finished_leaves(engine):
    a = EngineRequest("a", chat(engine, PROMPTS[1]), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    engine.add_request(a)
    engine.step()  # a prefills
    engine.step()
    assert engine.num_running == 1
    b = EngineRequest("b", chat(engine, PROMPTS[3]), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    engine.add_request(b)
    outs = engine.step()  # b prefills in the same step as a decodes
    assert {o.request_id for o in outs} == {"a", "b"}
    assert engine.num_running == 2
    outs = engine.step()
    assert any(o.request_id == "b" and o.finished for o in outs)
    assert engine.num_running == 1  # b left at once
    engine.abort("a")
    assert not engine.has_unfinished()


def test_abort_frees_blocks_at_once(engine):
    free_before = engine.block_manager.num_free_blocks
    engine.add_request(EngineRequest("ab", chat(engine, PROMPTS[4]) * 3, SamplingParams(max_tokens=100)))
    engine.step()
    assert engine.block_manager.num_free_blocks < free_before
    engine.abort("ab")
    assert engine.block_manager.num_free_blocks == free_before
    assert not engine.has_unfinished()
    assert engine.step() == []


def test_too_long_prompt_rejected(engine):
    with pytest.raises(RequestRejected) as e:
        engine.add_request(EngineRequest("long", [100] * (engine.max_model_len + 5), SamplingParams()))
    assert e.value.code == "context_length_exceeded"


def test_an_output_budget_that_cannot_fit_is_refused_not_shortened(engine, configured, monkeypatch):
    ids = chat(engine, PROMPTS[0])
    room = engine.max_model_len - len(ids)
    assert engine.max_output_tokens(len(ids)) == room  # this engine's KV pool holds its whole context
    with pytest.raises(RequestRejected) as e:
        engine.add_request(EngineRequest("over", ids, SamplingParams(max_tokens=room + 1)))
    assert (e.value.code, e.value.param) == ("context_length_exceeded", "max_tokens")
    assert not engine.has_unfinished()
    monkeypatch.setattr(engine, "capacity_tokens", len(ids) + 10)  # a KV pool smaller than the context
    assert engine.max_output_tokens(len(ids)) == 10
    with pytest.raises(RequestRejected) as e:
        engine.add_request(EngineRequest("pool", ids, SamplingParams(max_tokens=11)))
    assert e.value.param == "max_tokens" and "KV pool of" in str(e.value)
    with pytest.raises(RequestRejected) as e:  # the prompt alone fills the pool
        engine.add_request(EngineRequest("pool2", ids + [100] * 10, SamplingParams(max_tokens=1)))
    assert (e.value.code, e.value.param) == ("context_length_exceeded", "messages")
    monkeypatch.undo()
    capped = configured(req_max_output_len=8)
    assert capped.max_output_tokens(len(ids)) == 8
    with pytest.raises(RequestRejected) as e:
        capped.add_request(EngineRequest("cap", ids, SamplingParams(max_tokens=9)))
    assert e.value.param == "max_tokens" and "req_max_output_len 8" in str(e.value)
    outs = capped.generate([EngineRequest("fits", ids, SamplingParams(max_tokens=8, ignore_eos=True))])["fits"]
    assert (outs[-1].completion_tokens, outs[-1].finish_reason) == (8, "length")


def test_kv_usage_is_the_share_of_blocks_held(engine):
    assert engine.kv_usage() == 0.0  # nothing runs (cached prefix blocks nobody holds are free)
    engine.add_request(EngineRequest("kv", chat(engine, PROMPTS[3]), SamplingParams(max_tokens=50)))
    engine.step()
    bm = engine.block_manager
    assert engine.kv_usage() == (bm.num_blocks - bm.num_free_blocks) / bm.num_blocks > 0
    engine.abort("kv")
    assert engine.kv_usage() == 0.0


def test_pending_prefill_counts_the_prompt_tokens_not_yet_computed(configured):
    """What the router's time-to-first-token estimate reads: a 300-token prompt in chunks of 128 leaves
    300, then 172, then 44, then none, while the decoding request beside it adds nothing."""
    engine = configured(chunked_prefill_size=128, max_num_batched_tokens=128)
    decoding = EngineRequest("dec", engine.tokenizer.encode("Hi"), SamplingParams(temperature=0, max_tokens=8))
    engine.add_request(decoding)
    engine.step()
    assert engine.pending_prefill_tokens() == 0
    long = EngineRequest("long", [1000 + i for i in range(300)], SamplingParams(temperature=0, max_tokens=2))
    engine.add_request(long)
    seen = [engine.pending_prefill_tokens()]
    while engine.pending_prefill_tokens() > 0:
        engine.step()
        seen.append(engine.pending_prefill_tokens())
    assert seen[0] == 300 and seen[-1] == 0 and seen == sorted(seen, reverse=True) and len(seen) >= 3, seen
    engine.abort("dec")
    engine.abort("long")


def test_resumed_request_generates_only_the_rest(engine):
    ids = chat(engine, PROMPTS[6])
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    full = engine.generate([EngineRequest("full", ids, sp)])["full"]
    toks = tokens_of(full)
    resumed = engine.generate([EngineRequest("res", ids, sp, resume_token_ids=toks[:8])])["res"]
    assert tokens_of(resumed) == toks[8:]
    assert resumed[-1].completion_tokens == 20
    # The text continues exactly where the first 8 tokens stopped.
    assert engine.tokenizer.decode(toks[:8]) + text_of(resumed) == text_of(full)


def test_resumed_seeded_request_continues_the_same_random_stream(engine):
    ids = chat(engine, PROMPTS[7])
    sp = SamplingParams(temperature=1.0, max_tokens=16, seed=11, ignore_eos=True)
    toks = tokens_of(engine.generate([EngineRequest("sfull", ids, sp)])["sfull"])
    resumed = engine.generate([EngineRequest("sres", ids, sp, resume_token_ids=toks[:5])])["sres"]
    assert tokens_of(resumed) == toks[5:]


def test_prompt_logits_consistent_with_generation(engine):
    ids = chat(engine, PROMPTS[5])
    r = engine.generate([EngineRequest("g", ids, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))])
    toks = tokens_of(r["g"])
    logits = engine.prompt_logits(ids + toks[:3])
    assert torch.equal(logits[len(ids) - 1:].argmax(-1), torch.tensor(toks))
