"""Relaying a backend's choice stream to the client: collected per choice for a JSON body (`collect`),
or written as Server-Sent Events ending with `data: [DONE]` (`stream_sse`); the bytes themselves come
from gateway/openai's encoders. A failure before the first output becomes a real HTTP status; after
the headers went out it becomes an error event, and the usage chunk still reports what was billed.

A stream is relayed a batch at a time (what one upstream read delivered, `ChoiceStream.next_batch`):
one write per batch, and the last chunks, the usage chunk and `[DONE]` go out with the end of the body
in one write. Nothing waits for more: a batch is written as soon as it is encoded.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from aiohttp import web

from engine import RequestOutput
from gateway.backends.base import ChoiceStream
from gateway.http.errors import error_for_output
from gateway.messages import ChoiceOutput, is_failure
from gateway.openai.choices import ChoiceAcc, TokenUsage
from gateway.openai.chunks import DONE, ChunkEncoder, sse_event
from gateway.routing.router import BACKEND_HEADER

log = logging.getLogger("sluice.gateway")

UsageOf = Callable[[list[ChoiceAcc]], TokenUsage]  # a request's usage from its choices


def raise_for_output(out: RequestOutput) -> None:
    err = error_for_output(out)
    if err is not None:
        raise err


async def collect(stream: ChoiceStream, n: int) -> list[ChoiceAcc]:
    """Every output of a non-streamed request, per choice; the first failure raises its APIError. The
    stream is closed on the way out."""
    async with stream:
        return await read_all(stream, n)


async def read_all(stream: ChoiceStream, n: int) -> list[ChoiceAcc]:
    """As `collect`, leaving the stream open: the caller closes it (after sending the answer)."""
    accs = [ChoiceAcc() for _ in range(n)]
    while True:
        try:
            batch = await stream.next_batch()  # a relayed JSON answer is one batch
        except StopAsyncIteration:
            return accs
        for ch in batch:
            raise_for_output(ch.output)
            acc = accs[ch.index]
            if ch.output.text:
                acc.text.append(ch.output.text)
            acc.add(ch.output)


async def send_then_close(request: web.Request, resp: web.Response, stream: ChoiceStream) -> web.Response:
    """Sends a whole JSON answer, then closes its stream. Closing does the request's bookkeeping (usage
    and cost, metrics, the backend's slot): none of it needs to keep the client waiting, so the answer
    goes out first. A client already gone gets nothing; the stream is closed all the same."""
    try:
        await resp.prepare(request)
        await resp.write_eof()
    except ConnectionError:
        log.debug("the client left before its answer was sent")
    except BaseException:
        await stream.aclose()
        raise
    try:
        await stream.aclose()
    except Exception:  # the answer is out: a failure in the bookkeeping must not become a second response
        log.exception("closing the stream of an answered request failed")
    return resp


async def _first(stream: ChoiceStream) -> ChoiceOutput | None:
    """The first output, so engine rejections become a real HTTP status before the SSE headers."""
    try:
        first = await stream.__anext__()
    except StopAsyncIteration:
        return None
    raise_for_output(first.output)
    return first


async def stream_sse(request: web.Request, stream: ChoiceStream, n: int, encoder: ChunkEncoder,
                     usage: UsageOf | None, request_id: str) -> tuple[web.StreamResponse, int]:
    """The SSE answer; returns the response and the completion tokens it reported. `usage`: the
    request's usage from its choices, for the usage chunk (None: no usage chunk)."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                       "X-Accel-Buffering": "no"})
    accs = [ChoiceAcc() for _ in range(n)]
    async with stream:
        first = await _first(stream)
        resp.headers[BACKEND_HEADER] = stream.backend
        await resp.prepare(request)
        try:
            batch = [first] if first is not None else []
            held: list[bytes] = []  # once every choice finished: written with [DONE] and the end
            failed = False
            while not failed:
                if not batch:
                    try:
                        batch = await stream.next_batch()
                    except StopAsyncIteration:
                        break
                events, held = held, []
                for ch in batch:
                    out = ch.output
                    acc = accs[ch.index]
                    acc.add(out)  # an error output's tokens too: the usage chunk reports what was billed
                    if is_failure(out):
                        err = error_for_output(out)
                        if err is not None:
                            events.append(sse_event(err.body()))
                        failed = True
                        break
                    events.extend(encoder.events(ch.index, out, acc))
                batch = []
                if failed or all(a.finished for a in accs):
                    held = events
                elif events:
                    await resp.write(b"".join(events))
            if usage is not None:
                held.append(encoder.usage_event(usage(accs)))
            held.append(DONE)
            await resp.write_eof(b"".join(held))
        except (ConnectionResetError, ConnectionError):
            log.info("client disconnected mid-stream (request %s); cancelling", request_id)
    return resp, sum(a.completion_tokens for a in accs)
