"""One request through the official `openai` SDK, timed: a streamed chat completion, or an embeddings
call (`--endpoint embeddings`).

`Sender` holds one `AsyncOpenAI` client (the SDK's aiohttp transport, no retries: a failure is a
result), the API key of each tier, and the endpoint it sends to. Each chat request is sent with
`stream=True` and `stream_options.include_usage`, through `.with_streaming_response` so the response
headers are read (`x-sluice-backend`: where Sluice served it; "unknown" when absent, as from any other
server). Each embeddings request is `client.embeddings.with_raw_response.create(model=..., input=[...])`
(the SDK's own request: it asks for `encoding_format: base64` unless `--extra-body` names one, and
decodes the answer), for its headers, then `.parse()`.

Measured per request, from just before the SDK call:
* TTFT: the first chunk that carries text (content, or a reasoning model's reasoning text); a
  role-only first chunk does not count;
* inter-token latencies: the gaps between successive chunks that carry text (one per chunk: a server
  that packs several tokens into one chunk shows fewer, longer gaps);
* end-to-end: until the stream ends;
* output tokens: `usage.completion_tokens` of the final usage chunk, else the text chunks counted;
* error kind: `http_<status>` for an HTTP error status, `stream_error(<code>)` for an error event
  inside a 200 stream, `not_sse` for a 200 that is not `text/event-stream` (a proxy's HTML page),
  `empty_stream` for one without a chunk, `timeout` past `--timeout`, `connect_error` when no
  connection could be made (refused, unknown host), `connection_closed` when the server closed it
  before the answer ended (a dropped keep-alive connection too), else the exception's class name
  (`APIConnectionError`, `APITimeoutError`, ...). The kinds of connection failures come from the
  transport's own exception: the SDK's aiohttp transport reports both as `APITimeoutError`.

Measured per embeddings request: end-to-end (until the whole answer is read and parsed), the inputs
sent, `usage.prompt_tokens`, and the error kinds above plus `not_json` (a 200 that is not JSON),
`bad_json` (a JSON content type whose body does not parse) and `bad_embeddings` (JSON without one
embedding per input, e.g. 3 for 4 inputs). There is no stream: no TTFT, no inter-token latencies.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import cast

import aiohttp
import httpx2
import openai
from openai.types import CreateEmbeddingResponse
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionStreamOptionsParam

from loadgen.workload import RequestSpec

BACKEND_HEADER = "x-sluice-backend"  # as gateway/routing/router.py sets it; not imported: loadgen is a plain client
UNKNOWN = "unknown"
ENDPOINTS = ("chat", "embeddings")


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 3)


@dataclass
class RequestResult:
    """What happened to one request. Times are milliseconds (rounded to the microsecond, so the JSON
    and the summary computed from it agree to the last digit); `start_s` is seconds since its level
    started."""

    index: int
    tier: str
    model: str
    backend: str = UNKNOWN
    ok: bool = False
    error: str | None = None
    error_detail: str | None = None
    start_s: float = 0.0
    ttft_ms: float | None = None
    itl_ms: list[float] = field(default_factory=list)
    e2e_ms: float = 0.0
    output_tokens: int = 0
    output_tokens_from: str = "chunks"  # "usage": the final usage chunk reported it
    text_chunks: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    prompt_words: int = 0
    inputs: int | None = None  # embeddings: the inputs this request carried (None: a chat request)
    cost: float | None = None  # set by stats.Prices; None: no price for this model / backend

    def to_json(self) -> dict[str, object]:
        return asdict(self)


def _has_text(chunk: openai.types.chat.ChatCompletionChunk) -> bool:
    for choice in chunk.choices:
        delta = choice.delta
        if delta.content:
            return True
        extra = delta.model_extra or {}
        if extra.get("reasoning_content") or extra.get("reasoning"):
            return True
    return False


class BadResponse(Exception):
    """A 200 that is not a usable answer; `kind` names how (the error kind of the result)."""

    def __init__(self, kind: str, detail: str):
        super().__init__(detail)
        self.kind = kind


class BadStream(BadResponse):
    """A 200 that is not a usable stream: not `text/event-stream` (a proxy's HTML page), or no chunk."""


class NotOpenAI(Exception):
    """The server answered, but not with OpenAI's JSON (an HTML page, another API)."""


def _causes(e: BaseException) -> list[BaseException]:
    """`e` and the exceptions it was raised from, outermost first."""
    chain: list[BaseException] = []
    current: BaseException | None = e
    while current is not None and current not in chain:
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain


def connection_failure(e: BaseException) -> tuple[str, str] | None:
    """(kind, detail) when `e` comes from a connection that could not be made or that the server closed;
    None for anything else (a timeout stays a timeout)."""
    for cause in _causes(e):
        if isinstance(cause, (aiohttp.ServerTimeoutError, TimeoutError)):
            return None
        if isinstance(cause, (aiohttp.ClientConnectorError, ConnectionRefusedError)):
            return "connect_error", str(cause)[:200]
        if isinstance(cause, (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError, aiohttp.ClientPayloadError,
                              ConnectionResetError)):
            return "connection_closed", (str(cause) or type(cause).__name__)[:200]
    return None


def error_kind(e: BaseException) -> tuple[str, str]:
    """(kind, detail) of a failed request, as the results and the error table name it."""
    if isinstance(e, BadResponse):
        return e.kind, str(e)
    failure = connection_failure(e)
    if failure is not None:
        return failure
    if isinstance(e, openai.APIStatusError):
        return f"http_{e.status_code}", str(e.message)[:200]
    if isinstance(e, TimeoutError):
        return "timeout", "no complete answer within --timeout"
    if isinstance(e, openai.APIError) and not isinstance(e, openai.APIConnectionError):
        code = e.code or (e.body.get("code") if isinstance(e.body, dict) else None)
        return (f"stream_error({code})" if code else "stream_error"), str(e.message)[:200]
    return type(e).__name__, str(e)[:200]


class Sender:
    """Sends RequestSpecs to one base URL's `endpoint` ("chat" or "embeddings"). `keys`: the API key per
    tier (`default_key` for the others)."""

    def __init__(self, base_url: str, keys: dict[str, str], default_key: str, *, timeout_s: float = 300.0,
                 max_connections: int = 1024, endpoint: str = "chat"):
        if endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint {endpoint!r}: one of {', '.join(ENDPOINTS)}")
        self.endpoint = endpoint
        self.keys = keys
        self.timeout_s = timeout_s
        limits = httpx2.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self.http = openai.DefaultAioHttpClient(limits=limits, timeout=timeout_s, follow_redirects=False)
        self.client = openai.AsyncOpenAI(base_url=base_url, api_key=default_key, max_retries=0, timeout=timeout_s,
                                         http_client=self.http)

    def key(self, tier: str) -> str | None:
        return self.keys.get(tier)

    async def close(self) -> None:
        await self.client.close()

    async def models(self) -> list[str]:
        """Model ids from `GET /models`; NotOpenAI when the answer is not OpenAI's model list (the SDK
        would fail on it with an AttributeError of its own)."""
        resp = await self.client.get("/models", cast_to=httpx2.Response)
        where = f"the server at {self.client.base_url} did not answer OpenAI JSON to GET /models"
        content_type = resp.headers.get("content-type", "")
        try:
            body = resp.json()
        except ValueError:
            raise NotOpenAI(f"{where} (HTTP {resp.status_code}, content-type {content_type!r})") from None
        data = body.get("data") if isinstance(body, dict) else None
        if not isinstance(data, list) or not all(isinstance(m, dict) and isinstance(m.get("id"), str) for m in data):
            raise NotOpenAI(f"{where} (no list of models with ids in `data`)")
        return [m["id"] for m in data]

    async def send(self, spec: RequestSpec, level_t0: float) -> RequestResult:
        """Sends one request to this sender's endpoint; every failure is a result (never raised)."""
        if self.endpoint == "embeddings":
            return await self.send_embeddings(spec, level_t0)
        return await self.send_chat(spec, level_t0)

    def _headers(self, tier: str) -> dict[str, str]:
        key = self.key(tier)
        return {"Authorization": f"Bearer {key}"} if key else {}

    async def send_embeddings(self, spec: RequestSpec, level_t0: float) -> RequestResult:
        body = dict(spec.body)
        model = str(body.pop("model"))
        inputs = [str(x) for x in cast(list[object], body.pop("input"))]
        res = RequestResult(index=spec.index, tier=spec.tier, model=model, prompt_words=spec.prompt_words,
                            inputs=len(inputs))
        t0 = time.perf_counter()
        res.start_s = round(t0 - level_t0, 6)
        try:
            async with asyncio.timeout(self.timeout_s):
                raw = await self.client.embeddings.with_raw_response.create(
                    model=model, input=inputs, extra_body=body or None, extra_headers=self._headers(spec.tier))
                res.backend = raw.headers.get(BACKEND_HEADER) or UNKNOWN
                content_type = raw.headers.get("content-type", "")
                not_json = BadResponse("not_json", f"HTTP {raw.status_code} with content-type {content_type!r}")
                try:
                    parsed: object = raw.parse()
                except json.JSONDecodeError as e:
                    raise BadResponse("bad_json", f"HTTP {raw.status_code}: the body is not JSON ({e.msg})") from None
                except (ValueError, AttributeError, TypeError) as e:  # the SDK's decoding of `data`
                    if "json" not in content_type:  # it decoded the page's text (a proxy's HTML)
                        raise not_json from None
                    raise BadResponse("bad_embeddings", (str(e) or type(e).__name__)[:200]) from None
            if not isinstance(parsed, CreateEmbeddingResponse):
                raise not_json
            data = getattr(parsed, "data", None)  # the SDK builds it unvalidated: a field may be missing
            if not isinstance(data, list):
                raise BadResponse("bad_embeddings", f"HTTP {raw.status_code}: JSON without a `data` list")
            if len(data) != len(inputs):
                raise BadResponse("bad_embeddings", f"{len(data)} embeddings for {len(inputs)} inputs")
            usage = getattr(parsed, "usage", None)
            tokens = getattr(usage, "prompt_tokens", None)
            res.prompt_tokens = tokens if isinstance(tokens, int) else None
            res.ok = True
        except Exception as e:  # every failure is a result, by kind
            res.error, res.error_detail = error_kind(e)
            if isinstance(e, openai.APIStatusError):
                res.backend = e.response.headers.get(BACKEND_HEADER) or res.backend
        res.e2e_ms = _ms(time.perf_counter() - t0)
        return res

    async def send_chat(self, spec: RequestSpec, level_t0: float) -> RequestResult:
        body = dict(spec.body)
        model = str(body.pop("model"))
        messages = cast(Iterable[ChatCompletionMessageParam], body.pop("messages"))
        body.pop("stream", None)
        options = body.pop("stream_options", None)
        stream_options = cast(ChatCompletionStreamOptionsParam,
                              {**(options if isinstance(options, dict) else {}), "include_usage": True})
        headers = self._headers(spec.tier)
        res = RequestResult(index=spec.index, tier=spec.tier, model=model, prompt_words=spec.prompt_words)
        t0 = time.perf_counter()
        res.start_s = round(t0 - level_t0, 6)
        last = t0
        usage_tokens: int | None = None
        try:
            async with asyncio.timeout(self.timeout_s):
                async with self.client.chat.completions.with_streaming_response.create(
                        model=model, messages=messages, stream=True, stream_options=stream_options,
                        extra_body=body or None, extra_headers=headers) as resp:
                    res.backend = resp.headers.get(BACKEND_HEADER) or UNKNOWN
                    content_type = resp.headers.get("content-type", "")
                    if "text/event-stream" not in content_type:
                        raise BadStream("not_sse", f"HTTP {resp.status_code} with content-type {content_type!r}")
                    stream = await resp.parse()
                    chunks = 0
                    async for chunk in stream:
                        chunks += 1
                        now = time.perf_counter()
                        if chunk.usage is not None:
                            usage_tokens = chunk.usage.completion_tokens
                            res.prompt_tokens = chunk.usage.prompt_tokens
                            details = chunk.usage.prompt_tokens_details
                            res.cached_tokens = details.cached_tokens if details is not None else None
                        if _has_text(chunk):
                            if res.ttft_ms is None:
                                res.ttft_ms = _ms(now - t0)
                            else:
                                res.itl_ms.append(_ms(now - last))
                            last = now
                            res.text_chunks += 1
                    if not chunks:
                        raise BadStream("empty_stream", "the stream ended without a chunk")
            res.ok = True
        except Exception as e:  # every failure is a result, by kind
            res.error, res.error_detail = error_kind(e)
            if isinstance(e, openai.APIStatusError):
                res.backend = e.response.headers.get(BACKEND_HEADER) or res.backend
        res.e2e_ms = _ms(time.perf_counter() - t0)
        if usage_tokens is not None:
            res.output_tokens, res.output_tokens_from = usage_tokens, "usage"
        else:
            res.output_tokens = res.text_chunks
        return res
