"""Unit tests (fake clock): circuit breaker, limiter, Retry-After parsing, provider order."""

from __future__ import annotations

import pytest

from gateway.admission.limits import MemoryLimiter, RedisLimiter
from gateway.backends.remote.backend import RemoteBackend
from gateway.backends.remote.breaker import CircuitBreaker
from gateway.backends.remote.provider import retry_after_seconds
from gateway.settings import LimitSettings, ProviderSettings, RoutingSettings


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_breaker_opens_half_opens_and_closes():
    c = Clock()
    b = CircuitBreaker(failures=3, cooldown_s=10, clock=c)
    for _ in range(2):
        assert b.allow()
        b.failure()
    assert b.state == "closed"
    b.success()  # a success resets the count
    for _ in range(3):
        b.failure()
    assert b.state == "open" and not b.allow() and b.retry_in() == 10
    c.t += 10
    assert b.state == "half_open"
    assert b.allow() and not b.allow()  # one probe at a time
    b.failure()  # the probe failed: open again for a full cool-down
    assert b.state == "open"
    c.t += 10
    assert b.allow()
    b.success()
    assert b.state == "closed" and b.allow()


def test_breaker_probe_released_without_verdict():
    c = Clock()
    b = CircuitBreaker(failures=1, cooldown_s=1, clock=c)
    b.failure()
    c.t += 1
    assert b.allow()
    b.release()
    assert b.allow()


async def test_memory_limiter_rpm_tpm_and_windows():
    c = Clock(600.0)
    lim = MemoryLimiter(LimitSettings(keys={"k": {"rpm": 3, "tpm": 100}}, tiers={"standard": {"rpm": 1}}), clock=c)
    assert [(await lim.admit("k", "standard")).ok for _ in range(4)] == [True, True, True, False]
    v = await lim.admit("k", "standard")
    assert v.reason == "rpm" and v.retry_after == 60
    c.t += 59.5
    assert (await lim.admit("k", "standard")).retry_after == pytest.approx(0.5)
    c.t += 0.5  # the next window
    assert (await lim.admit("k", "standard")).ok
    await lim.charge_tokens("k", "standard", 100)
    v = await lim.admit("k", "standard")
    assert not v.ok and v.reason == "tpm"
    # tier default for other keys; a budget
    assert (await lim.admit("x", "standard")).ok and not (await lim.admit("x", "standard")).ok
    lim2 = MemoryLimiter(LimitSettings(keys={"b": {"budget": 1.0}}), clock=c)
    assert (await lim2.admit("b", "pro", spent=0.99)).ok
    assert (await lim2.admit("b", "pro", spent=1.0)).reason == "budget"


@pytest.mark.redis
async def test_redis_limiter_is_shared_and_atomic(redis_server):
    import asyncio

    c = Clock(1200.0)
    settings = LimitSettings(keys={"k": {"rpm": 50}})
    g1 = RedisLimiter(settings, redis_server.url, clock=c)
    g2 = RedisLimiter(settings, redis_server.url, clock=c)
    try:
        verdicts = await asyncio.gather(*[(g1 if i % 2 else g2).admit("k", "pro") for i in range(80)])
        assert sum(v.ok for v in verdicts) == 50  # two "gateways", one count
    finally:
        await g1.redis.flushdb()
        await g1.close()
        await g2.close()


def test_retry_after_forms():
    assert retry_after_seconds({"retry-after": "3"}) == 3
    assert retry_after_seconds({"retry-after-ms": "250"}) == 0.25
    assert retry_after_seconds({}) is None
    assert 0 <= retry_after_seconds({"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}) == 0


async def test_provider_order_and_weights():
    def mk(n: str, o: int, w: float = 1.0) -> ProviderSettings:
        return ProviderSettings(name=n, base_url="http://127.0.0.1:1/v1", models={"m": "m"}, order=o, weight=w)
    rb = RemoteBackend([mk("c", 1), mk("a", 0, 9.0), mk("b", 0, 1.0)], RoutingSettings())
    firsts = [rb.order(rb.chain("m"))[0].name for _ in range(2000)]
    assert rb.order(rb.chain("m"))[-1].name == "c"
    assert 0.85 < firsts.count("a") / 2000 < 0.95
    await rb.close()


def test_cost():
    p = ProviderSettings(name="p", base_url="http://x", input_price_per_m=1.0, output_price_per_m=4.0,
                         cached_input_price_per_m=0.5)
    assert p.cost(1_000_000, 200_000, 500_000) == pytest.approx(0.8 + 0.1 + 2.0)


async def test_transport_errors_are_classified_as_connection_failures():
    """The provider's client wraps aiohttp's errors in the SDK's; a refused connection or a server that
    hangs up is still a connection failure, a slow answer a timeout."""
    import asyncio
    import socket

    from aiohttp import web

    from gateway.backends.remote.provider import Provider, classify

    async def hang(request):
        await asyncio.sleep(5)
        return web.json_response({})

    async def reset(request):
        request.transport.close()
        return web.Response()

    app = web.Application()
    app.router.add_post("/hang/chat/completions", hang)
    app.router.add_post("/reset/chat/completions", reset)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    closed_port = s.getsockname()[1]
    s.close()
    try:
        for base, kind in [(f"http://127.0.0.1:{closed_port}", "connection"),
                           (f"http://127.0.0.1:{port}/reset", "connection"),
                           (f"http://127.0.0.1:{port}/hang", "timeout")]:
            p = Provider(ProviderSettings(name="p", base_url=base, timeout_s=0.3), RoutingSettings())
            try:
                with pytest.raises(Exception) as ei:
                    await p.post("chat", b"{}")
                f = classify(p, ei.value)
                assert f is not None and f.kind == kind, (base, f)
            finally:
                await p.close()
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("status", [400, 401, 403, 404, 409, 413, 422, 429, 500, 503, 418])
@pytest.mark.parametrize("content", [b'{"error": {"message": "nope", "type": "x", "param": "p", "code": "c"}}',
                                     b'{"detail": "flat"}', b"<html>bad gateway</html>", b"", b"[1, 2]"])
def test_error_answers_raise_what_the_sdk_raised(status, content):
    """`status_error` builds the exception the openai SDK built for the same answer (type, message, body)."""
    import httpx2
    import openai

    from gateway.backends.remote.provider import status_error

    url = "http://127.0.0.1:9/v1/chat/completions"
    headers = [(b"content-type", b"application/json"), (b"retry-after", b"3")]
    sdk = openai.AsyncOpenAI(api_key="k", base_url="http://127.0.0.1:9/v1")
    want = sdk._make_status_error_from_response(
        httpx2.Response(status, headers=headers, content=content, request=httpx2.Request("POST", url)))
    got = status_error(status, headers, content, url)
    assert type(got) is type(want)
    assert (got.message, got.body, got.status_code, got.code, got.param, got.type) == \
           (want.message, want.body, want.status_code, want.code, want.param, want.type)
    assert got.response.headers.get("retry-after") == "3"


def test_mid_stream_transport_errors_classify_as_before():
    """A body read that fails is named as the SDK's aiohttp transport named it."""
    import aiohttp

    from gateway.backends.remote.provider import Provider, classify, transport_error

    p = Provider(ProviderSettings(name="p", base_url="http://127.0.0.1:9/v1"), RoutingSettings())
    for err, kind, message in [(aiohttp.ClientPayloadError("cut"), "connection", "connection failed (ReadError)"),
                               (aiohttp.ServerDisconnectedError(), "connection", "connection failed (ConnectTimeout)"),
                               (aiohttp.SocketTimeoutError("slow"), "timeout", "timed out"),
                               (TimeoutError(), "timeout", "timed out")]:
        f = classify(p, transport_error(err))
        assert f is not None and (f.kind, f.message) == (kind, message), err
