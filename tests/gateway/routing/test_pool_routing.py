"""The router with an engine pool (`[[engines]]`): a pooled model is served by its replicas
(`x-sluice-backend: engine:<name>`, priced at the local price), listed in /v1/models, spread over the
replicas; when every replica is full past the tier's target it overflows to a provider or, with none,
is refused early with 429; when every replica fails before the first token a provider answers. Embedding
models the same way."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp.test_utils import TestServer

from bench.mock_engine import EngineModel, make_app
from bench.server import free_port
from gateway.state import STATE
from tests.fixtures.providers import chat, gateway, post, provider_cfg, stream_text

POOLED = "pooled-model"


async def _replica(**model) -> TestServer:
    server = TestServer(make_app(EngineModel(**model), model_name=POOLED), host="127.0.0.1")
    await server.start_server()
    return server


def _samples(metric, name: str) -> list[tuple[dict[str, str], float]]:
    return [(s.labels, s.value) for fam in metric.collect() for s in fam.samples if s.name == name]


def _cfg(name: str, port: int, **kw) -> dict:
    return {"name": name, "base_url": f"http://127.0.0.1:{port}/v1", "kind": "vllm", "models": [POOLED], **kw}


async def test_a_pooled_model_is_served_by_its_replicas_and_spread_over_them(tmp_path):
    a, b = await _replica(max_running=4, decode_ms=20), await _replica(max_running=4, decode_ms=20)
    try:
        async with gateway(tmp_path, [], replicas=[_cfg("a", a.port), _cfg("b", b.port)],
                           routing={"local_price": {"input_per_m": 1.0, "output_per_m": 1.0}}) as (base, app, *_):
            async with aiohttp.ClientSession() as s, s.get(base + "/v1/models") as r:
                assert POOLED in [m["id"] for m in (await r.json())["data"]]
            answers = await asyncio.gather(*(post(base, chat(POOLED, f"q{i}", max_tokens=6, stream=i % 2 == 0))
                                             for i in range(8)))
            seen = set()
            for i, (status, headers, body) in enumerate(answers):
                assert status == 200, body
                seen.add(headers["x-sluice-backend"])
                text = stream_text(body) if i % 2 == 0 else body["choices"][0]["message"]["content"]
                assert text == "".join(f" t{k}" for k in range(1, 7))
            assert seen == {"engine:a", "engine:b"}
            # Priced at the local price (1 per million tokens each way), by replica.
            costs = _samples(app[STATE].metrics.usage_cost.metric, "sluice_usage_cost_total")
            assert {lab["backend"] for lab, _ in costs} == {"engine:a", "engine:b"}
            assert all(v > 0 for _, v in costs)
            decisions = _samples(app[STATE].metrics.decisions.metric, "sluice_route_decisions_total")
            assert sum(v for lab, v in decisions if lab["backend"] == "engine" and lab["reason"] == "pool") == 8
    finally:
        await a.close()
        await b.close()


async def test_full_replicas_overflow_past_the_tier_target_or_are_refused_early(tmp_path, providers):
    prov, _ = providers
    server = await _replica(max_running=1, decode_ms=40, per_seq_ms=0)
    tiers = {"pro": {"priority": 0, "max_queue_wait_ms": 300}, "standard": {"priority": 1, "max_queue_wait_ms": 200}}
    try:
        cfg = _cfg("a", server.port, max_in_flight=1)
        async with gateway(tmp_path, [provider_cfg(prov, models={POOLED: "up-a"})], replicas=[cfg],
                           tiers=tiers) as (base, *_):
            busy = asyncio.create_task(post(base, chat(POOLED, max_tokens=30)))
            await asyncio.sleep(0.1)
            status, headers, body = await post(base, chat(POOLED, max_tokens=4))
            assert status == 200 and headers["x-sluice-backend"] == "remote:a"
            assert (await busy)[1]["x-sluice-backend"] == "engine:a"
        async with gateway(tmp_path, [], replicas=[cfg], tiers=tiers) as (base, *_):
            busy = asyncio.create_task(post(base, chat(POOLED, max_tokens=30)))
            await asyncio.sleep(0.1)
            status, headers, body = await post(base, chat(POOLED, max_tokens=4))
            assert status == 429 and body["error"]["code"] == "engines_busy" and headers["Retry-After"] == "1"
            assert (await busy)[0] == 200
    finally:
        await server.close()


async def test_every_replica_failing_before_the_first_token_moves_the_request_to_a_provider(tmp_path, providers):
    prov, _ = providers
    dead = free_port()
    async with gateway(tmp_path, [provider_cfg(prov, models={POOLED: "up-a"})], replicas=[_cfg("a", dead)],
                       routing={"max_attempts": 1}) as (base, app, *_):
        for stream in (False, True):
            status, headers, body = await post(base, chat(POOLED, max_tokens=4, stream=stream))
            assert status == 200 and headers["x-sluice-backend"] == "remote:a", body
        decisions = _samples(app[STATE].metrics.decisions.metric, "sluice_route_decisions_total")
        assert sum(v for lab, v in decisions if lab["backend"] == "remote" and lab["reason"] == "pool_failed") == 2


async def test_the_embedded_engine_is_one_more_member_taking_requests_while_it_has_a_free_slot(tmp_path):
    from tests.fixtures.fake_engine import FakeEngine
    from tests.fixtures.providers import LOCAL_MODEL
    replica = TestServer(make_app(EngineModel(max_running=8, decode_ms=5), model_name=LOCAL_MODEL), host="127.0.0.1")
    await replica.start_server()
    eng = FakeEngine(max_running_requests=2)
    try:
        cfg = {**_cfg("a", replica.port), "models": [LOCAL_MODEL]}
        async with gateway(tmp_path, [], engine=eng, replicas=[cfg]) as (base, *_):
            status, headers, _ = await post(base, chat(LOCAL_MODEL, max_tokens=3))
            assert status == 200 and headers["x-sluice-backend"] == "local"  # idle embedded engine first
            eng.gate.clear()  # hold the embedded engine's requests: its two slots fill
            held = [asyncio.create_task(post(base, chat(LOCAL_MODEL, f"held {i}", max_tokens=3))) for i in range(2)]
            await asyncio.sleep(0.3)
            status, headers, body = await post(base, chat(LOCAL_MODEL, max_tokens=3))
            assert status == 200 and headers["x-sluice-backend"] == "engine:a", body
            eng.gate.set()
            assert [h["x-sluice-backend"] for _, h, _ in await asyncio.gather(*held)] == ["local", "local"]
    finally:
        await replica.close()


async def test_a_full_pool_leaves_the_providers_first_token_time_out_of_the_wait(tmp_path, providers):
    """The tier's target is a time to first token: a request that will overflow after waiting for room
    waits the target less the provider's learnt first-token time, not the whole target."""
    prov, _ = providers
    server = await _replica(max_running=1, decode_ms=40, per_seq_ms=0)
    tiers = {"pro": {"priority": 0, "max_queue_wait_ms": 3000}, "standard": {"priority": 1, "max_queue_wait_ms": 600}}
    try:
        cfg = _cfg("a", server.port, max_in_flight=1)
        async with gateway(tmp_path, [provider_cfg(prov, models={POOLED: "up-a"})], replicas=[cfg],
                           tiers=tiers) as (base, app, *_):
            remote = app[STATE].remote
            assert remote is not None and remote.first_token_s(POOLED) is None
            status, _, body = await post(base, chat(POOLED, max_tokens=4, stream=True))  # the pool is free
            assert status == 200
            for _ in range(3):
                remote.providers[0].first_token.observe(0.5)  # as if its streams took 0.5 s to start
            assert remote.first_token_s(POOLED) == 0.5
            busy = asyncio.create_task(post(base, chat(POOLED, max_tokens=60)))
            await asyncio.sleep(0.1)
            t0 = asyncio.get_running_loop().time()
            status, headers, _ = await post(base, chat(POOLED, max_tokens=4, stream=True))
            waited = asyncio.get_running_loop().time() - t0
            assert status == 200 and headers["x-sluice-backend"] == "remote:a"
            assert waited < 0.45, waited  # 0.1 s of waiting (0.6 - 0.5), not 0.6 s
            mean = remote.providers[0].first_token.mean
            assert mean is not None and mean < 0.5  # the stream it served is learnt (it started far sooner)
            await busy
    finally:
        await server.close()


POOLED_EMBED = "pooled-embedder"


async def _embed_replica(**model) -> TestServer:
    server = TestServer(make_app(EngineModel(**model), model_name=POOLED_EMBED), host="127.0.0.1")
    await server.start_server()
    return server


def _embed_cfg(name: str, port: int, **kw) -> dict:
    return {**_cfg(name, port, **kw), "models": [POOLED_EMBED]}


async def test_an_embedding_model_with_a_pool_is_served_by_its_replicas_spread_and_moved_off_a_dead_one(
        tmp_path, providers):
    """Embedding models route as chat does: spread over the replicas with room (each answer the replica's
    vectors, labelled `engine:<name>`), a replica refusing connections skipped for the next, and a
    provider when every replica is down."""
    from bench.mock_engine import mock_vector
    from tests.fixtures.mock_provider import embedding_vector

    prov, _ = providers
    a, b = await _embed_replica(max_running=1, decode_ms=30), await _embed_replica(max_running=1, decode_ms=30)
    try:
        async with gateway(tmp_path, [], replicas=[_embed_cfg("a", a.port), _embed_cfg("b", b.port)],
                           routing={"local_price": {"input_per_m": 1.0, "output_per_m": 1.0}}) as (base, app, *_):
            texts = [f"passage number {i}" for i in range(6)]
            answers = await asyncio.gather(*(post(base, {"model": POOLED_EMBED, "input": [t, t + "!"]},
                                                  path="/v1/embeddings") for t in texts))
            seen = set()
            for t, (status, headers, body) in zip(texts, answers):
                assert status == 200, body
                seen.add(headers["x-sluice-backend"])
                assert body["model"] == POOLED_EMBED
                assert [d["embedding"] for d in body["data"]] == [mock_vector(t), mock_vector(t + "!")]
                assert body["usage"]["prompt_tokens"] > 0
            assert seen == {"engine:a", "engine:b"}
            decisions = _samples(app[STATE].metrics.decisions.metric, "sluice_route_decisions_total")
            assert sum(v for lab, v in decisions if lab["backend"] == "engine" and lab["reason"] == "pool") == 6
            costs = _samples(app[STATE].metrics.usage_cost.metric, "sluice_usage_cost_total")
            assert {lab["backend"] for lab, _ in costs} == {"engine:a", "engine:b"}  # the local price
    finally:
        await a.close()
    dead = free_port()
    try:
        async with gateway(tmp_path, [], replicas=[_embed_cfg("dead", dead), _embed_cfg("b", b.port)],
                           routing={"max_attempts": 2}) as (base, *_):
            for _ in range(3):
                status, headers, body = await post(base, {"model": POOLED_EMBED, "input": "hello"},
                                                   path="/v1/embeddings")
                assert status == 200 and headers["x-sluice-backend"] == "engine:b", body
                assert body["data"][0]["embedding"] == mock_vector("hello")
    finally:
        await b.close()
    async with gateway(tmp_path, [provider_cfg(prov, models={POOLED_EMBED: "up-a"})],
                       replicas=[_embed_cfg("dead", dead)], routing={"max_attempts": 1}) as (base, app, *_):
        status, headers, body = await post(base, {"model": POOLED_EMBED, "input": "hello"}, path="/v1/embeddings")
        assert status == 200 and headers["x-sluice-backend"] == "remote:a", body
        assert body["data"][0]["embedding"] == embedding_vector("hello", len(body["data"][0]["embedding"]))
        decisions = _samples(app[STATE].metrics.decisions.metric, "sluice_route_decisions_total")
        assert sum(v for lab, v in decisions if lab["backend"] == "remote" and lab["reason"] == "pool_failed") == 1


async def test_a_full_embedding_pool_refuses_early_with_429_where_nothing_else_serves_the_model(tmp_path):
    server = await _embed_replica(max_running=1, decode_ms=400, per_seq_ms=0)
    tiers = {"pro": {"priority": 0, "max_queue_wait_ms": 300}, "standard": {"priority": 1, "max_queue_wait_ms": 200}}
    try:
        async with gateway(tmp_path, [], replicas=[_embed_cfg("a", server.port, max_in_flight=1)],
                           tiers=tiers) as (base, *_):
            busy = asyncio.create_task(post(base, {"model": POOLED_EMBED, "input": "first"}, path="/v1/embeddings"))
            await asyncio.sleep(0.1)
            status, headers, body = await post(base, {"model": POOLED_EMBED, "input": "x"}, path="/v1/embeddings")
            assert status == 429 and body["error"]["code"] == "engines_busy" and headers["Retry-After"] == "1"
            status, headers, _ = await busy
            assert status == 200 and headers["x-sluice-backend"] == "engine:a"
    finally:
        await server.close()
