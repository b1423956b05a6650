"""A provider's answers and failures (gateway/backends/remote/provider.py): Retry-After parsing, transport
errors classified as the SDK classified them, and error answers raised as the SDK raised them."""

from __future__ import annotations

import pytest

from gateway.backends.remote.provider import retry_after_seconds
from gateway.settings import ProviderSettings, RoutingSettings


def test_retry_after_reads_seconds_milliseconds_and_http_dates():
    assert retry_after_seconds({"retry-after": "3"}) == 3
    assert retry_after_seconds({"retry-after-ms": "250"}) == 0.25
    assert retry_after_seconds({}) is None
    assert 0 <= retry_after_seconds({"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}) == 0


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


def test_mid_stream_transport_errors_are_named_as_the_sdk_named_them():
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
