"""RemoteBackend: OpenAI-compatible providers behind retries, backoff, circuit breakers and failover.

Each provider has one aiohttp session (one connection pool; provider.py says why not the openai SDK,
whose exception types it still raises). The body the client sent (validated, with the Sluice-only
fields removed and the model name mapped) is forwarded as is, and the answer's bytes are read without
building SDK objects: a relayed chunk costs one JSON parse. A stream is relayed a socket read at a
time: the outputs of one read go to the client together (`next_batch`), one write per read.

Tries are rounds over the provider chain (order, then weight), driven by tenacity:
  * in a round each provider whose breaker is closed (or half-open and free for a probe), that is not
    at `max_concurrent` and not inside a Retry-After it gave us, gets one try; a failure (5xx, timeout,
    connection error, a stream cut before its first text, a 200 whose body is not JSON/SSE, any error
    no rule knows) counts against its breaker and moves on to the next provider at once;
  * a 429 is back-pressure, not a fault: it never counts against the breaker; the provider is skipped
    for its Retry-After (a healthy fallback serves at once). A request that finds every provider
    inside a Retry-After window answers 429 with that Retry-After at once;
  * 400/413/422 are the caller's fault and answered as they are; 401/403 are a configuration error
    (the provider refuses our key): no retry, its breaker opens at once, the next provider serves, and
    the log and `/ready` say why; a 404 (the model mapping) moves on without retrying it;
  * when a round fails, tenacity waits (the soonest Retry-After, else exponential backoff with full
    jitter) and tries again, at most `max_attempts` rounds, and never past the request's deadline
    (the first round runs without it: building its retry state costs more than most requests);
  * then the client gets 429 (every provider rate-limited us) or 503, with Retry-After.
A stream is committed once a chunk with real text arrived (a role-only first chunk is not); before
that every failure is retried invisibly; after it a failure ends the stream with an error event.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import random
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import openai
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, stop_after_attempt
from tenacity.stop import stop_base

from engine import RequestOutput
from gateway import jsonio
from gateway.backends.base import Backend, ChoiceStream
from gateway.backends.remote.provider import (
    AttemptFailure,
    BadResponse,
    Provider,
    RoundFailed,
    StreamDropped,
    UpstreamError,
    classify,
    transport_error,
)
from gateway.errors import APIError, Failure
from gateway.messages import ChoiceOutput, ErrorOutput, GenerationRequest
from gateway.observability.metrics import Metrics
from gateway.settings import ProviderSettings, RoutingSettings

log = logging.getLogger("sluice.remote")

# Fields of Sluice's request models that providers do not know (extras of vLLM and Sluice).
SLUICE_ONLY_FIELDS = frozenset({"top_k", "stop_token_ids", "ignore_eos", "prompt_truncation", "cache_salt",
                                "repetition_penalty", "min_tokens", "guided_json"})


def _json_body(status: int, content_type: str, content: bytes) -> dict[str, Any]:
    """The parsed body of a JSON answer; anything else is the provider's failure, not the caller's."""
    ctype = content_type.split(";")[0] or "no content type"
    try:
        body = jsonio.loads(content)
    except ValueError:
        raise BadResponse(f"answered {status} with a body that is not JSON ({ctype})") from None
    if not isinstance(body, dict):
        raise BadResponse(f"answered {status} with JSON that is not an object")
    if not isinstance(body.get("choices"), list):
        if isinstance(body.get("error"), (dict, str)):
            raise UpstreamError(body["error"])
        raise BadResponse(f"answered {status} without `choices`")
    return body


def _text(data: bytes) -> str:
    return data.decode("utf-8", "replace")


def _line_json(data: bytes) -> object:
    """One `data:` line's JSON. Bytes that are not UTF-8 are read as the SDK's line decoder read them
    (invalid bytes replaced), not refused."""
    try:
        return jsonio.loads(data)
    except ValueError:
        try:
            return json.loads(_text(data))
        except ValueError:
            raise BadResponse(f"a stream line that is not JSON ({_text(data[:60])!r})") from None


async def _sse_lines(resp: aiohttp.ClientResponse) -> AsyncIterator[list[bytes]]:
    """The lines of an event stream (split at LF, CRLF or CR), a list per socket read: no await per
    line. A transport failure raises as the SDK's transport raised it (`transport_error`)."""
    buf = b""
    try:
        async for data in resp.content.iter_any():
            buf += data
            if b"\r" in buf:
                buf = buf.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
            if b"\n" not in buf:
                continue
            *lines, buf = buf.split(b"\n")
            yield lines
    except (TimeoutError, aiohttp.ClientError) as e:
        raise transport_error(e) from e
    if buf:
        yield [buf]


def _client_error(e: openai.APIStatusError) -> APIError:
    body = e.body if isinstance(e.body, dict) else {}
    err = body.get("error", body) if isinstance(body, dict) else {}
    if not isinstance(err, dict):
        err = {}
    return APIError(e.status_code, str(err.get("message") or e.message), param=err.get("param"),
                    code=err.get("code"))


@dataclass
class _Parsed:
    """Accumulated facts of one upstream answer."""

    prompt_tokens: int | None = None
    cached_tokens: int = 0
    completion_tokens: int | None = None
    pending_finish: dict[int, str] = field(default_factory=dict)
    text_chunks: int = 0
    done: bool = False  # `data: [DONE]` seen


def _usage_into(parsed: _Parsed, usage: dict[str, Any] | None) -> None:
    if not usage:
        return
    parsed.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    parsed.completion_tokens = int(usage.get("completion_tokens") or 0)
    details = usage.get("prompt_tokens_details") or {}
    parsed.cached_tokens = int((details or {}).get("cached_tokens") or usage.get("prompt_cache_hit_tokens") or 0)


@dataclass
class TryResult:
    """What one successful try delivered. A JSON answer: every output (`rest` None). A stream: the
    outputs read up to and including the first real text (the stream is then committed), and the
    outputs still to come (`rest`: the same iterator, so nothing it read is lost; None when the whole
    answer is already here); `parsed` accumulates the stream's facts (its usage) as `rest` is read."""

    outputs: list[ChoiceOutput]
    parsed: _Parsed
    rest: AsyncIterator[list[ChoiceOutput]] | None = None


class stop_when(stop_base):
    """A tenacity stop condition from a predicate (so it composes with `|`)."""

    def __init__(self, predicate: Callable[[RetryCallState], bool]):
        self.predicate = predicate

    def __call__(self, retry_state: RetryCallState) -> bool:
        return self.predicate(retry_state)


class RemoteStream(ChoiceStream):
    def __init__(self, backend: RemoteBackend, gen: GenerationRequest, chain: list[Provider]):
        self._remote = backend
        self._gen = gen
        self._chain = chain
        self._backend = "remote"  # "remote:<provider>" once a provider answers
        self.provider: Provider | None = None
        self._prompt_tokens: int | None = None
        self._excluded: set[Provider] = set()  # refused our configuration: not retried for this request
        self._last_kind: dict[str, str] = {}  # provider -> its last failure or reason it was skipped
        self._failures: list[AttemptFailure] = []  # every failed try of this request
        self._it: AsyncGenerator[list[ChoiceOutput], None] = self._run()  # a list per upstream read
        self._ready: collections.deque[ChoiceOutput] = collections.deque()  # read, not yet handed out
        self._resp: aiohttp.ClientResponse | None = None
        self._closed = False
        self._holding = False  # counted in self.provider.in_flight

    @property
    def backend(self) -> str:
        return self._backend

    @property
    def prompt_tokens(self) -> int | None:
        return self._prompt_tokens

    @property
    def provider_settings(self) -> ProviderSettings | None:
        return self.provider.settings if self.provider is not None else None

    # ---------------------------------------------------------------- plumbing

    async def __anext__(self) -> ChoiceOutput:
        if self._closed:
            raise StopAsyncIteration
        while not self._ready:
            self._ready.extend(await self._it.__anext__())
        return self._ready.popleft()

    async def next_batch(self) -> list[ChoiceOutput]:
        """What is already here (the rest of the last read), else every output of the next read."""
        if self._closed:
            raise StopAsyncIteration
        if self._ready:
            outs = list(self._ready)
            self._ready.clear()
            return outs
        while True:
            outs = await self._it.__anext__()
            if outs:
                return outs

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await self._it.aclose()
        finally:
            await self._release()

    async def _release(self) -> None:
        await self._release_resp()
        if self.provider is not None and self._holding:
            self._holding = False
            self.provider.in_flight -= 1

    # ---------------------------------------------------------------- the upstream body

    def _body(self, p: Provider) -> dict[str, Any]:
        api = self._gen.api
        assert api is not None  # the handler always passes the validated request
        body = api.model_dump(exclude_unset=True, exclude=set(SLUICE_ONLY_FIELDS))
        body["model"] = p.settings.models[self._gen.model]
        if body.get("stream"):
            body["stream_options"] = {"include_usage": True}  # every token is counted
        return body

    # ---------------------------------------------------------------- one try

    async def _try(self, p: Provider, deadline: float) -> TryResult:
        """One call to one provider: its answer, whole (JSON), or as far as the first real text (a stream)."""
        timeout = max(0.05, min(p.settings.timeout_s, deadline - time.monotonic()))
        body = self._body(p)
        if not body.get("stream"):
            resp = await p.post(self._gen.endpoint, jsonio.dumps(body), timeout)
            content = await p.read(resp)
            parsed = _Parsed()
            outputs = self._json_outputs(_json_body(resp.status, resp.headers.get("content-type", ""), content), parsed)
            return TryResult(outputs, parsed)
        resp = await p.post(self._gen.endpoint, jsonio.dumps(body), timeout)
        self._resp = resp
        ctype = resp.headers.get("content-type", "")
        if "html" in ctype:  # a proxy's error page with a 2xx status
            await self._release_resp()
            raise BadResponse(f"answered {resp.status} with {ctype.split(';')[0]}, not an event stream")
        parsed = _Parsed()
        rest = self._outputs(_sse_lines(resp), parsed)
        buffered: list[ChoiceOutput] = []
        try:
            async with asyncio.timeout(max(0.05, deadline - time.monotonic())):
                async for outs in rest:
                    buffered.extend(outs)
                    if outs and outs[-1].output.finished:  # the end: the whole answer is here
                        return TryResult(buffered, parsed)
                    if any(o.output.text for o in outs):
                        return TryResult(buffered, parsed, rest)
        except BaseException:
            await self._release_resp()
            raise
        raise AssertionError("_outputs ends with the finishing outputs or raises")  # pragma: no cover

    async def _release_resp(self) -> None:
        if self._resp is not None:
            resp, self._resp = self._resp, None
            try:
                if resp.content.at_eof():
                    resp.release()  # read to the end: the connection goes back to the pool
                else:
                    resp.close()  # cut short (a client gone, a failure): the provider stops generating
            except Exception as e:  # the upstream connection is discarded either way
                log.debug("closing an upstream response failed: %s", e)

    async def _outputs(self, lines: AsyncIterator[list[bytes]], parsed: _Parsed) -> AsyncIterator[list[ChoiceOutput]]:
        """Upstream SSE lines -> ChoiceOutputs, a list per upstream read; last the finishing outputs.
        Finish reasons are held until the usage chunk (or the end) so the finishing output carries the
        provider's token counts."""
        rid = self._gen.request_id
        chat = self._gen.endpoint == "chat"
        async for batch in lines:
            outs: list[ChoiceOutput] = []
            try:
                for line in batch:
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":  # keep reading to the end of the body: the connection then goes
                        parsed.done = True   # back to the pool instead of being closed
                        continue
                    chunk = _line_json(data)
                    if not isinstance(chunk, dict):
                        raise BadResponse(f"a stream line that is not a JSON object ({_text(data[:60])!r})")
                    if "error" in chunk and not chunk.get("choices"):
                        raise UpstreamError(chunk["error"])
                    _usage_into(parsed, chunk.get("usage"))
                    for c in chunk.get("choices") or ():
                        idx = int(c.get("index", 0))
                        text = ((c.get("delta") or {}).get("content") if chat else c.get("text")) or ""
                        if text:
                            parsed.text_chunks += 1
                            outs.append(ChoiceOutput(idx, RequestOutput(request_id=rid, text=text)))
                        if c.get("finish_reason"):
                            parsed.pending_finish[idx] = c["finish_reason"]
            except Exception:
                if outs:
                    yield outs  # what arrived before the bad line still goes out
                raise
            if outs:
                yield outs
        if not parsed.done and not parsed.pending_finish:
            raise StreamDropped()
        yield self._finish(parsed)

    def _finish(self, parsed: _Parsed) -> list[ChoiceOutput]:
        self._prompt_tokens = parsed.prompt_tokens
        completion = parsed.completion_tokens if parsed.completion_tokens is not None else parsed.text_chunks
        n = max(self._gen.n, max(parsed.pending_finish, default=0) + 1)
        outs = []
        for i in range(n):
            outs.append(ChoiceOutput(i, RequestOutput(
                request_id=self._gen.request_id, finished=True,
                finish_reason=parsed.pending_finish.get(i, "stop"),  # type: ignore[arg-type]
                prompt_tokens=parsed.prompt_tokens or 0, completion_tokens=completion if i == 0 else 0,
                cached_tokens=parsed.cached_tokens)))
        return outs

    def _json_outputs(self, body: dict[str, Any], parsed: _Parsed) -> list[ChoiceOutput]:
        _usage_into(parsed, body.get("usage"))
        chat = self._gen.endpoint == "chat"
        outs = []
        texts = 0
        for c in body.get("choices") or ():
            idx = int(c.get("index", 0))
            text = ((c.get("message") or {}).get("content") if chat else c.get("text")) or ""
            texts += bool(text)
            outs.append(ChoiceOutput(idx, RequestOutput(request_id=self._gen.request_id, text=text)))
            parsed.pending_finish[idx] = c.get("finish_reason") or "stop"
        parsed.text_chunks = texts
        return outs + self._finish(parsed)

    # ---------------------------------------------------------------- the try chain

    async def _open(self) -> tuple[Provider, TryResult]:
        b = self._remote
        r = b.routing
        start = time.monotonic()
        deadline = start + r.request_timeout_s
        if self._gen.deadline is not None:  # a wall-clock deadline set by the caller
            deadline = min(deadline, start + max(0.0, self._gen.deadline - time.time()))

        def wait_after(attempt: int, e: BaseException | None) -> float:
            """The wait after round `attempt` (1-based) failed with `e`."""
            hint = e.wait_hint if isinstance(e, RoundFailed) else None
            if hint:
                return hint + 0.005  # just past the Retry-After (or cool-down) it waits out
            cap = min(r.backoff_max_s, r.backoff_base_s * 2 ** (attempt - 1))
            return random.uniform(0, cap)

        def give_up(e: BaseException | None, sleep: float) -> bool:
            if isinstance(e, RoundFailed):
                if e.final:
                    return True
                if e.wait_hint is not None and e.wait_hint > r.max_retry_after_s:
                    return True
            return time.monotonic() + sleep >= deadline

        # Round 1 without tenacity; its retry state machine is built only when that round failed.
        try:
            return await self._round(deadline)
        except RoundFailed as e:
            last = e
        sleep = wait_after(1, last)
        if r.max_attempts <= 1 or give_up(last, sleep):
            raise self._give_up(last)
        await asyncio.sleep(sleep)

        def outcome(rs: RetryCallState) -> BaseException | None:
            return rs.outcome.exception() if rs.outcome else None

        try:  # rounds 2.. (tenacity's attempt k is round k + 1)
            async for attempt in AsyncRetrying(
                    stop=stop_after_attempt(r.max_attempts - 1) | stop_when(
                        lambda rs: give_up(outcome(rs), rs.upcoming_sleep)),
                    wait=lambda rs: wait_after(rs.attempt_number + 1, outcome(rs)),
                    retry=retry_if_exception_type(RoundFailed), reraise=True):
                with attempt:
                    return await self._round(deadline)
        except RoundFailed as e:
            last = e
        raise self._give_up(last)

    def _live(self) -> list[Provider]:
        """Providers this request may still wait for: not excluded by a configuration error."""
        return [p for p in self._chain if p not in self._excluded
                and not (p.config_error and not p.breaker.available())]

    async def _round(self, deadline: float) -> tuple[Provider, TryResult]:
        failures: list[AttemptFailure] = []
        tried = 0
        for p in self._remote.order(self._chain):
            if time.monotonic() >= deadline:
                break
            if p in self._excluded:
                continue
            why = p.unavailable(time.monotonic())
            if why is None and not p.breaker.allow():
                why = "circuit_open"
            if why is not None:
                self._last_kind[p.name] = why
                continue
            tried += 1
            p.in_flight += 1
            self.provider, self._holding = p, True
            b = self._remote
            t0 = time.monotonic()
            try:
                result = await self._try(p, deadline)
            except asyncio.CancelledError:
                p.breaker.release()
                await self._release()
                raise
            except Exception as e:
                await self._release()
                self.provider = None
                f = classify(p, e)
                if f is None:  # the caller's fault (400/413/422): answer it, count no failure
                    p.breaker.release()
                    if isinstance(e, openai.APIStatusError):
                        raise _client_error(e) from None
                    raise
                self._failed(p, f, e)
                failures.append(f)
                self._failures.append(f)
                b.on_attempt(p, f.kind, time.monotonic() - t0)
                continue
            p.breaker.success()
            p.config_error = None
            b.on_attempt(p, "ok", time.monotonic() - t0)
            return p, result
        now = time.monotonic()
        live = self._live()
        hints = [p.wait_hint(now) for p in live]
        hint = min(hints) if hints else None
        # Nothing left to wait for (every provider refused our configuration), or nothing tried because
        # every provider is inside a 429's Retry-After: answer now rather than wait.
        final = not live or (tried == 0 and all(self._last_kind.get(p.name) == "rate_limited" for p in live))
        raise RoundFailed(failures, hint if hint and hint > 0 else None, final)

    def _failed(self, p: Provider, f: AttemptFailure, e: BaseException) -> None:
        """Book one failed try: the breaker, the provider's Retry-After, the log."""
        self._last_kind[p.name] = f.kind
        more = "failing over" if any(q is not p and q.usable(time.monotonic()) for q in self._live()) \
            else "no other provider now"
        rid = self._gen.request_id
        if f.kind == "rate_limited":  # back-pressure, not a fault: the breaker does not count it
            p.breaker.release()
            if f.retry_after:
                p.hold(f.retry_after, "rate_limited")
            log.info("provider %s rate limited %s (%s%s); %s", p.name, rid, f.message,
                     f", Retry-After {f.retry_after:g} s" if f.retry_after else "", more)
            return
        if f.kind == "misconfigured":
            self._excluded.add(p)  # never retried for this request
            if f.status in (401, 403):
                p.config_error = f.message
                p.breaker.trip()
                log.error("provider %s: %s; its circuit is open for %g s (%s, request %s)", p.name, f.message,
                          p.breaker.cooldown_s, more, rid)
            else:
                p.breaker.release()
                log.warning("provider %s failed for %s: %s; %s", p.name, rid, f.message, more)
            return
        p.breaker.failure()
        if f.retry_after:
            p.hold(f.retry_after, "retry_after")
        log.warning("provider %s failed for %s: %s; %s", p.name, rid, f.message, more,
                    exc_info=e if f.kind == "error" else None)

    def _give_up(self, e: RoundFailed) -> APIError:
        now = time.monotonic()
        names = ", ".join(p.name for p in self._chain)
        live = self._live()
        model = self._gen.model
        if not live:  # every provider refused our configuration: say so, not "overloaded"
            last = {f.provider: f.message for f in self._failures}
            errors = "; ".join(f"{p.name}: {p.config_error or last.get(p.name) or 'misconfigured'}"
                               for p in self._chain)
            waits = [p.breaker.retry_in() for p in self._chain if p.breaker.retry_in() > 0]
            return APIError(503, f"No provider could serve `{model}`: a configuration error ({errors}).",
                            type="server_error", code="upstream_misconfigured",
                            retry_after=min(waits) if waits else None)
        if all(self._last_kind.get(p.name) == "rate_limited" for p in live):
            windows = [p.not_before - now for p in live if p.not_before > now]
            retry_after = min(windows) if windows else (e.wait_hint or 1.0)
            return APIError(429, f"Every provider for `{model}` is rate limiting ({names}); retry later.",
                            code="upstream_rate_limited", retry_after=max(retry_after, 1.0))
        retry_after = e.wait_hint if e.wait_hint else max(1.0, self._remote.routing.backoff_max_s / 5)
        detail = "; ".join(f"{f.provider}: {f.message}" for f in self._failures[-4:])
        if not detail:
            detail = "; ".join(f"{p.name}: {_SKIPPED.get(self._last_kind.get(p.name, ''), 'unavailable')}"
                               for p in live)
        return APIError(503, f"No provider could serve `{model}` ({detail}).", type="overloaded_error",
                        code="upstream_unavailable", retry_after=retry_after)

    # ---------------------------------------------------------------- the stream

    async def _run(self) -> AsyncGenerator[list[ChoiceOutput], None]:
        p, result = await self._open()
        self._backend = f"remote:{p.name}"
        parsed = result.parsed
        try:
            yield result.outputs
            if result.rest is None:  # the whole answer is here (a JSON answer, or a stream read to its end)
                return
            try:
                async for outs in result.rest:
                    yield outs
            except (Exception, StreamDropped) as e:  # committed: end with an error event, never silently
                f = classify(p, e)
                what = f.message if f else type(e).__name__
                log.warning("provider %s failed mid-stream for %s: %s", p.name, self._gen.request_id, what)
                self._prompt_tokens = parsed.prompt_tokens
                relayed = parsed.completion_tokens or parsed.text_chunks
                # The usage the client is told is the usage billed: the tokens relayed so far.
                yield [ChoiceOutput(0, ErrorOutput(
                    request_id=self._gen.request_id, finished=True, finish_reason="error",
                    error=f"The provider `{p.name}` failed mid-stream ({what}); the answer is incomplete.",
                    completion_tokens=relayed, prompt_tokens=parsed.prompt_tokens or 0,
                    cached_tokens=parsed.cached_tokens, error_code="provider_error", failure=Failure.PROVIDER))]
        finally:
            await self._release()


_SKIPPED = {"circuit_open": "circuit open", "busy": "at its concurrency limit",
            "rate_limited": "inside its Retry-After", "retry_after": "inside its Retry-After",
            "misconfigured": "misconfigured"}


class RemoteBackend(Backend):
    def __init__(self, providers: list[ProviderSettings], routing: RoutingSettings, metrics: Metrics | None = None):
        self.routing = routing
        names = [s.name for s in providers]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"duplicate provider names: {', '.join(dupes)} (each [[providers]] needs its own name)")
        for s in providers:
            if not s.models:
                log.warning("provider %s serves no models (its `models` table is empty): it is never called",
                            s.name)
        self.providers = [Provider(s, routing) for s in providers]
        self.metrics = metrics

    def status(self) -> dict[str, dict[str, Any]]:
        """Each provider's circuit, in-flight count and configuration error, for /ready."""
        return {p.name: p.status() for p in self.providers}

    def chain(self, model: str) -> list[Provider]:
        return [p for p in self.providers if model in p.settings.models]

    def models(self) -> list[str]:
        seen: dict[str, None] = {}
        for p in self.providers:
            for m in p.settings.models:
                seen[m] = None
        return list(seen)

    def order(self, chain: list[Provider]) -> list[Provider]:
        """By `order`; among equals, weighted random (weight w first with probability w/sum)."""
        if len(chain) < 2:
            return chain
        groups: dict[int, list[Provider]] = {}
        for p in chain:
            groups.setdefault(p.settings.order, []).append(p)
        out: list[Provider] = []
        for key in sorted(groups):
            g = list(groups[key])
            if len(g) > 1:
                g.sort(key=lambda p: -random.random() ** (1.0 / p.settings.weight))
            out.extend(g)
        return out

    def on_attempt(self, p: Provider, outcome: str, seconds: float) -> None:
        if self.metrics is not None:
            self.metrics.remote_attempt(p.name, outcome, seconds)

    async def submit(self, gen: GenerationRequest) -> ChoiceStream:
        chain = self.chain(gen.model)
        if not chain:
            raise APIError(404, f"The model `{gen.model}` does not exist.", param="model", code="model_not_found")
        return RemoteStream(self, gen, chain)

    async def close(self) -> None:
        for p in self.providers:
            try:
                await p.close()
            except Exception as e:  # shutting down: a connection pool that fails to close is not news
                log.debug("closing provider %s failed: %s", p.name, e)
