"""Relaying a choice stream (gateway/http/sse.py): a whole JSON answer goes out before its stream closes
(closing does the request's bookkeeping, which must not keep the client waiting), the stream is closed on
every path, and a failure while closing an answered stream never turns into a second response."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from engine import RequestOutput
from gateway.backends.base import ChoiceStream
from gateway.errors import APIError
from gateway.http.sse import read_all, send_then_close
from gateway.messages import ChoiceOutput


class ScriptedStream(ChoiceStream):
    """Hands out `batches`, then ends; `aclose` waits for `release` (when given) and may raise."""

    def __init__(self, batches: list[list[ChoiceOutput]], release: asyncio.Event | None = None,
                 close_error: Exception | None = None):
        self._batches = list(batches)
        self._release = release
        self._close_error = close_error
        self.closed = False
        self.reads = 0

    async def __anext__(self) -> ChoiceOutput:  # pragma: no cover - read_all reads batches
        raise AssertionError("read_all reads whole batches")

    async def next_batch(self) -> list[ChoiceOutput]:
        self.reads += 1
        if not self._batches:
            raise StopAsyncIteration
        return self._batches.pop(0)

    async def aclose(self) -> None:
        if self._release is not None:
            await asyncio.wait_for(self._release.wait(), 5)
        self.closed = True
        if self._close_error is not None:
            raise self._close_error


def _out(index: int, text: str = "", finished: bool = False, **kw: object) -> ChoiceOutput:
    return ChoiceOutput(index, RequestOutput(request_id="r", text=text, finished=finished,
                                             finish_reason="stop" if finished else None, **kw))  # type: ignore[arg-type]


async def test_read_all_gathers_each_choice_from_batches() -> None:
    stream = ScriptedStream([[_out(0, "He"), _out(1, "Wo")], [_out(0, "llo", True), _out(1, "rld", True)]])
    accs = await read_all(stream, 2)
    assert ["".join(a.text) for a in accs] == ["Hello", "World"]
    assert stream.reads == 3 and not stream.closed  # read to the end, left open for the caller


async def test_read_all_raises_the_first_failure() -> None:
    bad = ChoiceOutput(0, RequestOutput(request_id="r", finished=True, finish_reason="error", error="boom"))
    with pytest.raises(APIError):
        await read_all(ScriptedStream([[_out(0, "a")], [bad]]), 1)


async def _serve(stream: ScriptedStream) -> TestServer:
    async def handler(request: web.Request) -> web.StreamResponse:
        accs = await read_all(stream, 1)
        resp = web.Response(text="".join(accs[0].text))
        return await send_then_close(request, resp, stream)

    app = web.Application()
    app.router.add_post("/answer", handler)
    server = TestServer(app)
    await server.start_server()
    return server


async def test_the_answer_is_out_before_the_stream_closes() -> None:
    release = asyncio.Event()
    stream = ScriptedStream([[_out(0, "hi", True)]], release=release)
    server = await _serve(stream)
    try:
        async with aiohttp.ClientSession() as s, s.post(server.make_url("/answer")) as r:
            # The close is still waiting for this event: the body can only be here if it went out first.
            assert await asyncio.wait_for(r.text(), 3) == "hi"
            assert not stream.closed
            release.set()
        for _ in range(100):
            if stream.closed:
                break
            await asyncio.sleep(0.01)
        assert stream.closed
    finally:
        await server.close()


async def test_a_failing_close_after_the_answer_keeps_the_answer() -> None:
    stream = ScriptedStream([[_out(0, "ok", True)]], close_error=RuntimeError("bookkeeping broke"))
    server = await _serve(stream)
    try:
        async with aiohttp.ClientSession() as s, s.post(server.make_url("/answer")) as r:
            assert r.status == 200
            assert await r.text() == "ok"
        assert stream.closed
    finally:
        await server.close()
