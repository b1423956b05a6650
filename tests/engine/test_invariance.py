"""Greedy outputs do not change with chunked prefill, preemption and recompute, or prefix-cache hits: on the
native CPU step that serves by default and on the torch path (models the native step does not read)."""

from __future__ import annotations

import pytest

from engine import EngineRequest, SamplingParams

pytestmark = pytest.mark.model

CONTEXT = ("Sluice is a gateway that serves chat requests from a local engine and sends overflow to remote "
           "providers. It batches requests continuously, caches shared prompt prefixes, and never loses an "
           "accepted request. ") * 3


def requests(engine, tag, n=4, max_tokens=24):
    qs = ["What is Sluice?", "Does it lose requests?", "What does it cache?", "Where does overflow go?"]
    return [EngineRequest(f"{tag}{i}", engine.tokenizer.apply_chat_template(
        [{"role": "system", "content": CONTEXT}, {"role": "user", "content": qs[i % len(qs)]}]),
        SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)) for i in range(n)]


def outputs(engine, reqs):
    res = engine.generate(reqs)
    return [[t for o in res[r.request_id] for t in o.token_ids] for r in reqs]


def assert_same_or_near_tie(engine, reqs, got, want):
    for r, a, b in zip(reqs, got, want):
        if a == b:
            continue
        k = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
        logits = engine.prompt_logits(r.prompt_token_ids + b[:k])[-1]
        assert (logits[a[k]] - logits[b[k]]).abs().item() < 1e-3, f"{r.request_id} diverged at {k}: not a near-tie"


_BASELINES: dict[str, list[list[int]]] = {}


@pytest.fixture(params=["native", "torch"])
def configured_path(request):
    """The shared engine of either path under other settings (tests/engine/conftest.py)."""
    return request.getfixturevalue("configured" if request.param == "native" else "torch_configured")


@pytest.fixture
def baseline(request, configured_path):
    """Each path's outputs for `requests` in one unchunked prefill, no prefix cache and room for all: what
    every other setting must reproduce. Computed once per path and shared by the tests below (each ran
    the same four requests for its own baseline before)."""
    path = request.node.callspec.params["configured_path"]
    if path not in _BASELINES:
        engine = configured_path(chunked_prefill_size=0, max_num_batched_tokens=4096, enable_prefix_caching=False)
        _BASELINES[path] = outputs(engine, requests(engine, "base"))
    return _BASELINES[path]


def test_chunked_prefill_does_not_change_outputs(configured_path, baseline):
    configured = configured_path
    engine = configured(chunked_prefill_size=32, max_num_batched_tokens=64, enable_prefix_caching=False)
    reqs = requests(engine, "b")
    chunked = outputs(engine, reqs)
    assert engine.stats.steps > 0
    assert_same_or_near_tie(engine, reqs, chunked, baseline)


def test_preemption_and_recompute_do_not_change_outputs(configured_path, baseline):
    configured = configured_path
    engine = configured(enable_prefix_caching=False)
    reqs = requests(engine, "c")
    prompt_len = len(reqs[0].prompt_token_ids)
    # Room for three prompts and a little more: three are admitted, and as they grow one is preempted
    # and recomputed later.
    engine = configured(num_blocks=3 * prompt_len // 16 + 3, enable_prefix_caching=False)
    before = engine.stats.preemptions
    reqs = requests(engine, "d")
    got = outputs(engine, reqs)
    assert engine.stats.preemptions > before
    assert_same_or_near_tie(engine, reqs, got, baseline)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_prefix_cache_hits_do_not_change_outputs_and_skip_prefill(configured_path, baseline):
    configured = configured_path
    engine = configured(enable_prefix_caching=True)
    reqs = requests(engine, "f")
    first = outputs(engine, reqs[:1])
    prefill_before = engine.stats.prefill_tokens
    res = engine.generate(reqs[1:])
    rest = [[t for o in res[r.request_id] for t in o.token_ids] for r in reqs[1:]]
    computed = engine.stats.prefill_tokens - prefill_before
    cached = [res[r.request_id][-1].cached_tokens for r in reqs[1:]]
    prompt_total = sum(len(r.prompt_token_ids) for r in reqs[1:])
    assert all(c >= len(engine.tokenizer.encode(CONTEXT)) - 32 for c in cached), cached
    assert computed == prompt_total - sum(cached)  # cached tokens were not prefilled again
    assert_same_or_near_tie(engine, reqs, first + rest, baseline)


def test_native_int16_step_gives_the_same_tokens_however_requests_are_batched(configured):
    """The serving default's native CPU step with its int16 matmuls for every step size (wide_min_rows=0)
    computes each token row on its own: the same operations in the same order whatever else is in the
    step. So greedy outputs are identical, not merely near-tie close, alone or batched, in one prefill
    or in chunks of 32, and after prefix-cache hits (the gateway tests rely on it)."""
    engine = configured(enable_prefix_caching=False, chunked_prefill_size=0, max_num_batched_tokens=4096)
    if engine.runner.model.native is None:
        pytest.skip("no C compiler for the native CPU step")
    assert (engine.runner.kernels.wide_min_rows, engine.runner.kernels.amx_min_rows) == (0, 0)

    reqs = requests(engine, "alone", n=6)
    alone = [outputs(engine, [r])[0] for r in reqs]
    engine = configured(enable_prefix_caching=False, chunked_prefill_size=32, max_num_batched_tokens=64)
    assert outputs(engine, requests(engine, "chunked", n=6)) == alone
    engine = configured(enable_prefix_caching=True, chunked_prefill_size=256, max_num_batched_tokens=512)
    before = engine.stats.prefill_tokens
    first = outputs(engine, requests(engine, "warm", n=1))
    rest = outputs(engine, requests(engine, "hit", n=6)[1:])
    prefilled = engine.stats.prefill_tokens - before
    assert prefilled < 2 * sum(len(r.prompt_token_ids) for r in reqs)  # the hits skipped prefill
    assert first + rest == alone


def test_native_step_serves_a_prompt_longer_than_a_chunk(engine):
    """The serving default (native step, int8 or AMX matmuls from their measured row counts): a 700-token
    prompt runs as prefill chunks of 256 (steps that sample nothing), then decodes; the answer is the int16
    path's (the shared engine's)."""
    from engine import EngineConfig, LLMEngine

    if engine.runner.model.native is None:
        pytest.skip("no C compiler for the native CPU step")
    int16 = engine
    text = " ".join(f"item {i} is {i * 7 % 13}." for i in range(120))
    outs: list[list[int]] = []
    measured_rows = None  # the int8 and AMX thresholds the default measured
    for amx in (None, 0):
        if amx == 0 and measured_rows == (0, 0):
            outs.append(outs[0])  # no wide matmul here: the measured default is the int16 path already
            break
        engine = LLMEngine(EngineConfig(kv_cache_tokens=4096, max_model_len=2048)) if amx is None else int16
        if amx is None:
            measured_rows = (engine.runner.kernels.wide_min_rows, engine.runner.kernels.amx_min_rows)
        ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": text + " Which item is 5?"}])
        assert len(ids) > 2 * engine.config.chunked_prefill_size
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        res = engine.generate([EngineRequest("long", ids, params)])
        assert res["long"][-1].error is None and res["long"][-1].finish_reason == "length"
        outs.append([t for o in res["long"] for t in o.token_ids])
    assert len(outs[0]) == 6 and outs[0][:2] == outs[1][:2]  # wide matmuls vs int16: the same first tokens
