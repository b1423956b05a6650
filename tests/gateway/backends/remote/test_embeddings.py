"""RemoteBackend.embeddings against fault-injecting mock providers over real HTTP on loopback: the body
relayed (model mapped, `truncate` stripped), the answer checked, and the same tries as chat (failover,
Retry-After, the caller's 400, bad answers, giving up, breakers, the deadline, in-flight counts)."""

from __future__ import annotations

import base64
import struct
import time
from typing import Any

import pytest
from aiohttp import web

from gateway.backends.remote.backend import RemoteBackend
from gateway.errors import APIError
from gateway.settings import ProviderSettings, RoutingSettings
from tests.fixtures.mock_provider import EMBEDDING_DIMS, MockProvider, embedding_vector
from tests.fixtures.providers import provider_cfg

MODEL = "emb-model"


def backend(*provs: tuple[MockProvider, int], **routing: Any) -> RemoteBackend:
    """A RemoteBackend over mock providers ((provider, order) each) serving MODEL as `up-emb-<name>`."""
    settings = [ProviderSettings(**provider_cfg(m, order=o, models={MODEL: f"up-emb-{m.name}"})) for m, o in provs]
    r = {"backoff_base_s": 0.01, "backoff_max_s": 0.05, "breaker_cooldown_s": 30.0, **routing}
    return RemoteBackend(settings, RoutingSettings(**r))


@pytest.fixture
async def rb_ab(providers):
    """(a, b, backend): a first, b its fallback."""
    a, b = providers
    rb = backend((a, 0), (b, 1))
    yield a, b, rb
    await rb.close()


def body(inp: Any = "hello there world", **kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "input": inp, **kw}


def _in_flight(rb: RemoteBackend) -> list[int]:
    return [p.in_flight for p in rb.providers]


async def test_success_maps_the_model_strips_truncate_and_sets_the_model_back(rb_ab):
    a, b, rb = rb_ab
    ans = await rb.embeddings("r1", MODEL, body(["one two", "three"], truncate=True, dimensions=4,
                                                encoding_format="float", user="u1"))
    sent = a.requests[-1]
    assert sent["_path"] == "/v1/embeddings" and sent["_auth"] == "Bearer sk-upstream-a"
    assert sent["model"] == "up-emb-a" and "truncate" not in sent
    assert sent["dimensions"] == 4 and sent["user"] == "u1" and sent["encoding_format"] == "float"
    assert ans.body["model"] == MODEL  # the client's name, not the provider's
    assert ans.backend == "remote:a" and ans.provider.name == "a" and ans.provider.input_price_per_m == 1.0
    assert [d["embedding"] for d in ans.body["data"]] == [
        pytest.approx(embedding_vector("one two", 4)), pytest.approx(embedding_vector("three", 4))]
    assert [d["index"] for d in ans.body["data"]] == [0, 1]
    assert ans.body["usage"] == {"prompt_tokens": 3, "total_tokens": 3} and ans.prompt_tokens == 3
    assert b.count == 0 and _in_flight(rb) == [0, 0]


async def test_token_id_inputs_and_base64_vectors(rb_ab):
    a, _, rb = rb_ab
    ans = await rb.embeddings("r1", MODEL, body([[1, 2, 3], [4]], encoding_format="base64"))
    assert ans.prompt_tokens == 4 and len(ans.body["data"]) == 2
    raw = base64.b64decode(ans.body["data"][0]["embedding"])
    assert list(struct.unpack(f"<{EMBEDDING_DIMS}f", raw)) == pytest.approx(embedding_vector([1, 2, 3], EMBEDDING_DIMS))
    ans = await rb.embeddings("r2", MODEL, body([5, 6, 7]))  # one input given as token ids: one vector
    assert len(ans.body["data"]) == 1 and ans.prompt_tokens == 3
    assert ans.body["data"][0]["embedding"] == pytest.approx(embedding_vector([5, 6, 7], EMBEDDING_DIMS))


async def test_503_fails_over_to_the_healthy_provider(rb_ab):
    a, b, rb = rb_ab
    a.faults = [("status", 503)]
    ans = await rb.embeddings("r1", MODEL, body())
    assert ans.backend == "remote:b" and ans.body["model"] == MODEL
    assert b.requests[-1]["model"] == "up-emb-b"
    assert a.count == 1 and b.count == 1
    assert rb.providers[0].breaker.consecutive == 1  # counted against a
    assert _in_flight(rb) == [0, 0]


async def test_429_with_retry_after_then_success(providers):
    a, _ = providers
    a.faults = [("status", 429, 0.4)]
    rb = backend((a, 0))
    try:
        t0 = time.monotonic()
        ans = await rb.embeddings("r1", MODEL, body())
        assert time.monotonic() - t0 >= 0.4  # the Retry-After, not the 10 ms backoff
        assert ans.backend == "remote:a" and a.count == 2
        assert rb.providers[0].breaker.consecutive == 0  # back-pressure is not a fault
    finally:
        await rb.close()


async def test_a_400_is_passed_through_with_the_providers_message_and_not_retried(rb_ab):
    a, b, rb = rb_ab
    a.faults = [("status", 400)]
    with pytest.raises(APIError) as ei:
        await rb.embeddings("r1", MODEL, body())
    e = ei.value
    assert e.status == 400 and e.message == "a: injected 400" and e.code == "injected_400"
    assert a.count == 1 and b.count == 0
    assert rb.providers[0].breaker.consecutive == 0 and _in_flight(rb) == [0, 0]


async def test_the_mocks_own_400_names_its_param(rb_ab):
    a, b, rb = rb_ab
    with pytest.raises(APIError) as ei:
        await rb.embeddings("r1", MODEL, body({"not": "an input"}))
    assert ei.value.status == 400 and ei.value.param == "input" and b.count == 0


@pytest.mark.parametrize("fault", [("bad_json",), ("html",)])
async def test_an_answer_that_is_not_json_is_retried_on_the_next_provider(rb_ab, fault):
    a, b, rb = rb_ab
    a.faults = [fault]
    ans = await rb.embeddings("r1", MODEL, body())
    assert ans.backend == "remote:b" and len(ans.body["data"]) == 1
    assert a.count == 1 and b.count == 1
    assert rb.providers[0].breaker.consecutive == 1


@pytest.mark.parametrize("answer", [{"object": "list", "model": "x"},  # no `data`
                                    {"object": "list", "model": "x", "data": {"embedding": [0.5]}},  # not a list
                                    {"object": "list", "model": "x",  # one vector for two inputs
                                     "data": [{"object": "embedding", "index": 0, "embedding": [0.5]}]},
                                    {"object": "list", "model": "x", "data": [1, 2]}])  # items not embeddings
async def test_json_that_is_not_an_embeddings_answer_is_retried_on_the_next_provider(providers, answer):
    _, b = providers
    calls: list[dict] = []

    async def handle(request: web.Request) -> web.Response:
        calls.append(await request.json())
        return web.json_response(answer)

    app = web.Application()
    app.router.add_post("/v1/embeddings", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    odd = ProviderSettings(name="odd", base_url=f"http://127.0.0.1:{port}/v1", models={MODEL: "up-odd"},
                           timeout_s=2.0)
    rb = RemoteBackend([odd, ProviderSettings(**provider_cfg(b, order=1, models={MODEL: "up-emb-b"}))],
                       RoutingSettings(backoff_base_s=0.01, backoff_max_s=0.05))
    try:
        ans = await rb.embeddings("r1", MODEL, body(["x", "y"]))
        assert ans.backend == "remote:b" and len(ans.body["data"]) == 2
        assert len(calls) == 1 and calls[0]["model"] == "up-odd"
        assert rb.providers[0].breaker.consecutive == 1
    finally:
        await rb.close()
        await runner.cleanup()


async def test_all_providers_down_is_a_503_with_retry_after(providers):
    a, b = providers
    a.default_fault = ("status", 502)
    b.default_fault = ("reset",)
    rb = backend((a, 0), (b, 1), max_attempts=2)
    try:
        with pytest.raises(APIError) as ei:
            await rb.embeddings("r1", MODEL, body())
        e = ei.value
        assert e.status == 503 and e.code == "upstream_unavailable" and e.retry_after is not None
        assert "a: HTTP 502" in e.message and "b: connection failed" in e.message
        assert a.count == 2 and b.count == 2  # max_attempts rounds, each over both
        assert _in_flight(rb) == [0, 0]
    finally:
        await rb.close()


async def test_every_provider_rate_limiting_is_a_429_with_its_retry_after(providers):
    a, _ = providers
    a.default_fault = ("status", 429, 120)  # longer than max_retry_after_s: answered at once
    rb = backend((a, 0))
    try:
        t0 = time.monotonic()
        with pytest.raises(APIError) as ei:
            await rb.embeddings("r1", MODEL, body())
        assert ei.value.status == 429 and ei.value.code == "upstream_rate_limited"
        assert ei.value.retry_after == pytest.approx(120, abs=1)
        assert time.monotonic() - t0 < 1.0 and a.count == 1
    finally:
        await rb.close()


async def test_the_breaker_opens_after_repeated_failures(providers):
    a, b = providers
    a.default_fault = ("status", 500)
    rb = backend((a, 0), (b, 1), breaker_failures=2)
    try:
        for i in range(5):
            ans = await rb.embeddings(f"r{i}", MODEL, body())
            assert ans.backend == "remote:b"
        assert a.count == 2  # open after 2 failures: a is no longer called
        pa = rb.providers[0]
        assert pa.breaker.state == "open"
        pa.breaker.opened_at -= 60  # cool-down over: one probe goes to a, healthy again
        a.default_fault = None
        ans = await rb.embeddings("r9", MODEL, body())
        assert ans.backend == "remote:a" and pa.breaker.state == "closed"
    finally:
        await rb.close()


async def test_the_callers_deadline_ends_the_tries(providers):
    a, _ = providers
    a.default_fault = ("hang", 10)
    rb = backend((a, 0), max_attempts=10)
    try:
        t0 = time.monotonic()
        with pytest.raises(APIError) as ei:
            await rb.embeddings("r1", MODEL, body(), deadline=time.time() + 0.4)
        assert ei.value.status == 503
        assert 0.3 < time.monotonic() - t0 < 1.0  # not the provider's 2 s timeout, not 10 rounds
        assert _in_flight(rb) == [0]
    finally:
        await rb.close()


async def test_an_unknown_model_is_a_404():
    rb = RemoteBackend([ProviderSettings(name="p", base_url="http://127.0.0.1:1/v1", models={"m": "m"})],
                       RoutingSettings())
    try:
        with pytest.raises(APIError) as ei:
            await rb.embeddings("r1", "no-such-model", body())
        assert ei.value.status == 404 and ei.value.code == "model_not_found" and ei.value.param == "model"
    finally:
        await rb.close()
