"""Relaying an upstream event stream a socket read at a time (gateway/backends/remote/backend.py): what
arrives in one read goes out together, in order, and nothing a read carried is lost or repeated."""

from __future__ import annotations

import json

import pytest
from aiohttp import web

from tests.fixtures.mock_provider import MockProvider
from tests.fixtures.providers import REMOTE_MODEL, chat, gateway, post, provider_cfg, stream_text


def _chunk(text: str | None = None, *, role: bool = False, finish: str | None = None) -> bytes:
    delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text is not None else {})
    return b"data: " + json.dumps({"id": "up", "object": "chat.completion.chunk", "created": 1, "model": "up",
                                   "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}).encode()


USAGE = b'data: {"id":"up","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}'


class RawUpstream:
    """A provider whose event stream is `writes`, each sent as one write (one socket read, usually)."""

    def __init__(self, name: str, writes: list[bytes]):
        self.name = name
        self.writes = writes
        self.count = 0
        self.runner: web.AppRunner | None = None
        self.port = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.count += 1
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for w in self.writes:
            await resp.write(w)
        await resp.write_eof()
        return resp

    async def __aenter__(self) -> RawUpstream:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.runner is not None
        await self.runner.cleanup()


@pytest.fixture(autouse=True)
def _keys(monkeypatch):
    monkeypatch.setenv("SLUICE_TEST_RAW_KEY", "sk-raw")
    monkeypatch.setenv("SLUICE_TEST_A_KEY", "sk-a")


async def test_a_bad_line_after_text_in_the_same_read_ends_the_stream_with_an_error(tmp_path):
    """The text before it goes out, then the error event: the bad line is not skipped."""
    body = b"\n\n".join([_chunk(role=True), _chunk("hi"), _chunk(" there"), b"data: {not json"]) + b"\n\n"
    async with RawUpstream("raw", [body]) as up, gateway(tmp_path, [provider_cfg(up)]) as (base, *_):
        st, h, events = await post(base, chat(stream=True))
    assert st == 200 and h["x-sluice-backend"] == "remote:raw"
    assert stream_text(events) == "hi there"
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    assert len(errors) == 1 and "not JSON" in errors[0]["error"]["message"], events
    assert up.count == 1  # committed: never replayed


@pytest.mark.parametrize("eol", [b"\n", b"\r\n", b"\r"])
async def test_lines_split_anywhere_across_reads_and_any_line_ending(tmp_path, eol):
    body = eol.join([_chunk(role=True), b"", _chunk("a"), b"", _chunk("b\u00e9"), b"", _chunk(finish="stop"), b"",
                     USAGE, b"", b"data: [DONE]", b"", b""])
    writes = [body[i:i + 7] for i in range(0, len(body), 7)]  # 7-byte pieces: lines and CRLFs cut anywhere
    async with RawUpstream("raw", writes) as up, gateway(tmp_path, [provider_cfg(up)]) as (base, *_):
        st, _, events = await post(base, chat(stream=True, stream_options={"include_usage": True}))
    assert st == 200 and stream_text(events) == "ab\u00e9", events
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 2
    finishes = [c["finish_reason"] for e in events if isinstance(e, dict) for c in e["choices"]
                if c["finish_reason"]]
    assert finishes == ["stop"]


async def test_a_stream_without_text_has_one_finish_chunk(tmp_path):
    """Before: the finish chunk came twice when the answer had no text at all."""
    a = await MockProvider("a", tokens=0).start()
    try:
        async with gateway(tmp_path, [provider_cfg(a)]) as (base, *_):
            st, _, events = await post(base, chat(stream=True, stream_options={"include_usage": True}))
            assert st == 200
            assert [e["choices"][0]["delta"] for e in events[:2]] == [{"role": "assistant", "content": ""}, {}]
            assert events[1]["choices"][0]["finish_reason"] == "stop"
            assert events[2]["choices"] == [] and events[2]["usage"]["completion_tokens"] == 0
            assert events[3:] == ["[DONE]"]
            st, _, events = await post(base, {"model": REMOTE_MODEL, "prompt": "x", "stream": True},
                                       path="/v1/completions")
            assert st == 200 and len(events) == 2 and events[0]["choices"][0]["finish_reason"] == "stop"
    finally:
        await a.stop()
