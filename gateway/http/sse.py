"""Turning a backend's choice stream into the client's answer: one JSON body, or Server-Sent Events
ending with `data: [DONE]`. A failure before the first output becomes a real HTTP status; after the
headers went out it becomes an error event, and the usage chunk still reports what was billed."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from engine.request import RequestOutput
from gateway.backends.base import ChoiceStream
from gateway.http.errors import error_for_output
from gateway.http.openai_schema import PromptTokensDetails, Usage
from gateway.messages import ChoiceOutput, is_failure
from gateway.routing.router import BACKEND_HEADER

log = logging.getLogger("sluice.gateway")


@dataclass
class ChoiceAcc:
    """What one choice produced so far."""

    text: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    completion_tokens: int = 0
    cached_tokens: int = 0
    started: bool = False

    def add(self, out: RequestOutput) -> None:
        self.completion_tokens = max(self.completion_tokens, out.completion_tokens)
        self.cached_tokens = max(self.cached_tokens, out.cached_tokens)
        if out.finished:
            self.finish_reason = out.finish_reason


def usage_of(prompt_tokens: int, accs: list[ChoiceAcc]) -> Usage:
    completion = sum(a.completion_tokens for a in accs)
    cached = max((a.cached_tokens for a in accs), default=0)
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion, total_tokens=prompt_tokens + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


def raise_for_output(out: RequestOutput) -> None:
    err = error_for_output(out)
    if err is not None:
        raise err


async def collect(stream: ChoiceStream, n: int) -> list[ChoiceAcc]:
    """Every output of a non-streamed request, per choice; the first failure raises its APIError."""
    accs = [ChoiceAcc() for _ in range(n)]
    async with stream:
        async for ch in stream:
            raise_for_output(ch.output)
            acc = accs[ch.index]
            if ch.output.text:
                acc.text.append(ch.output.text)
            acc.add(ch.output)
    return accs


def sse_event(obj: dict[str, Any] | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    return f"data: {data}\n\n".encode()


async def _first(stream: ChoiceStream) -> ChoiceOutput | None:
    """The first output, so engine rejections become a real HTTP status before the SSE headers."""
    try:
        first = await stream.__anext__()
    except StopAsyncIteration:
        return None
    raise_for_output(first.output)
    return first


ChunkMaker = Callable[[int, RequestOutput, ChoiceAcc], list[dict[str, Any]]]
UsageChunkMaker = Callable[[list[ChoiceAcc]], dict[str, Any] | None]


async def stream_sse(request: web.Request, stream: ChoiceStream, n: int, make_chunks: ChunkMaker,
                     make_usage_chunk: UsageChunkMaker, request_id: str) -> tuple[web.StreamResponse, int]:
    """The SSE answer; returns the response and the completion tokens it reported."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                       "X-Accel-Buffering": "no"})
    accs = [ChoiceAcc() for _ in range(n)]
    async with stream:
        first = await _first(stream)
        resp.headers[BACKEND_HEADER] = stream.backend
        await resp.prepare(request)
        try:
            pending = [first] if first is not None else []
            while True:
                if pending:
                    ch = pending.pop()
                else:
                    try:
                        ch = await stream.__anext__()
                    except StopAsyncIteration:
                        break
                out = ch.output
                acc = accs[ch.index]
                acc.add(out)  # an error output's tokens too: the usage chunk reports what was billed
                if is_failure(out):
                    err = error_for_output(out)
                    if err is not None:
                        await resp.write(sse_event(err.body()))
                    break
                for chunk in make_chunks(ch.index, out, acc):
                    await resp.write(sse_event(chunk))
            usage_chunk = make_usage_chunk(accs)
            if usage_chunk is not None:
                await resp.write(sse_event(usage_chunk))
            await resp.write(sse_event("[DONE]"))
            await resp.write_eof()
        except (ConnectionResetError, ConnectionError):
            log.info("client disconnected mid-stream (request %s); cancelling", request_id)
    return resp, sum(a.completion_tokens for a in accs)
