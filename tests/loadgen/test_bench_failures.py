"""`sluice bench` against servers that fail: each failure is reported as what it is, and a run with
no success is a failed run. Real sockets: a closed port, and small aiohttp servers of this file's own."""

from __future__ import annotations

import io
import json
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from rich.console import Console

from loadgen.cli import amain

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def bench(*argv: str) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `sluice bench --no-progress ARGV`."""
    out, err = io.StringIO(), io.StringIO()
    rc = await amain(["--no-progress", "--no-gateway-usage", *argv], console=Console(file=out, width=250),
                     err_console=Console(file=err, width=250))
    return rc, out.getvalue(), err.getvalue()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once it is closed


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[dict[str, Handler]], Awaitable[str]]]:
    """Starts an aiohttp server with the given GET/POST handlers by path; returns its /v1 base URL."""
    servers: list[TestServer] = []

    async def start(routes: dict[str, Handler]) -> str:
        app = web.Application()
        for path, handler in routes.items():
            app.router.add_route("*", path, handler)
        server = TestServer(app, host="127.0.0.1")
        await server.start_server()
        servers.append(server)
        return f"http://127.0.0.1:{server.port}/v1"

    yield start
    for s in servers:
        await s.close()


async def one_token_stream(request: web.Request) -> web.StreamResponse:
    """A valid streamed chat answer of one token."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for delta, finish in (({"role": "assistant", "content": "hi"}, None), ({}, "stop")):
        chunk = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
                 "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
        await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def test_a_refused_connection_is_a_connect_error_at_once_and_fails_the_run(tmp_path):
    base = f"http://127.0.0.1:{closed_port()}/v1"
    out = tmp_path / "run.json"
    t0 = time.perf_counter()
    rc, text, err = await bench("--base-url", base, "--model", "m", "--requests", "3", "--warmup", "0",
                                "--json", str(out))
    took = time.perf_counter() - t0
    summary = json.loads(out.read_text())["levels"][0]["summary"]
    assert summary["errors_by_kind"] == {"connect_error": 3}, summary["errors_by_kind"]
    assert "APITimeoutError" not in text + err and "connect_error: 3" in text
    assert rc == 1 and "every request failed" in err, (rc, err)
    assert took < 2.0, f"{took:.2f} s for three refused connections"

    rc, _, err = await bench("--base-url", base, "--requests", "1")  # no --model: GET /models first
    assert rc == 2 and "connect_error" in err and "APITimeoutError" not in err, err


async def test_a_connection_the_server_closes_is_connection_closed(serve, tmp_path):
    count = 0

    async def every_other_closes(request: web.Request) -> web.StreamResponse:
        nonlocal count
        count += 1
        if count % 2 == 0:  # the kept-alive connection of the answer before, closed without an answer
            assert request.transport is not None
            request.transport.close()
            return web.Response()
        return await one_token_stream(request)

    base = await serve({"/v1/chat/completions": every_other_closes})
    out = tmp_path / "run.json"
    rc, text, _ = await bench("--base-url", base, "--model", "m", "--requests", "6", "--warmup", "0",
                              "--json", str(out))
    summary = json.loads(out.read_text())["levels"][0]["summary"]
    assert summary["ok"] == 3 and summary["errors_by_kind"] == {"connection_closed": 3}, summary["errors_by_kind"]
    assert "APITimeoutError" not in text and rc == 0


@pytest.mark.parametrize("html", [True, False])
async def test_a_models_answer_that_is_not_openai_json_says_so(serve, html):
    async def answer(request: web.Request) -> web.StreamResponse:
        assert request.method == "GET"
        if html:  # a web server's page where the API was expected
            return web.Response(text="<html><body><h1>Welcome to nginx!</h1></body></html>", content_type="text/html")
        return web.json_response({"status": "ok"})  # JSON, but not a model list

    base = await serve({"/v1/models": answer})
    rc, _, err = await bench("--base-url", base, "--requests", "1", "--warmup", "0")
    assert rc == 2, err
    assert f"the server at {base}" in err.replace("\n", "") and "did not answer OpenAI JSON" in err.replace("\n", "")
    assert "AttributeError" not in err and "_set_private_attributes" not in err


async def test_a_run_with_some_successes_still_exits_0(serve):
    count = 0

    async def first_fails(request: web.Request) -> web.StreamResponse:
        nonlocal count
        count += 1
        if count == 1:
            return web.json_response({"error": {"message": "boom", "type": "server_error"}}, status=500)
        return await one_token_stream(request)

    base = await serve({"/v1/chat/completions": first_fails})
    rc, text, err = await bench("--base-url", base, "--model", "m", "--requests", "3", "--warmup", "0")
    assert rc == 0 and "2 / 3" in text and "every request failed" not in err


async def test_a_run_where_every_request_failed_exits_1(serve, tmp_path):
    async def always_500(request: web.Request) -> web.StreamResponse:
        assert request.method == "POST"
        return web.json_response({"error": {"message": "boom", "type": "server_error"}}, status=500)

    base = await serve({"/v1/chat/completions": always_500})
    out = tmp_path / "run.json"
    rc, text, err = await bench("--base-url", base, "--model", "m", "--requests", "3", "--warmup", "0",
                                "--json", str(out))
    assert "0 / 3" in text and json.loads(out.read_text())["levels"][0]["summary"]["ok"] == 0  # still reported
    assert rc == 1, rc
    assert "every request failed (0/3 succeeded; http_500: 3)" in err.replace("\n", ""), err
