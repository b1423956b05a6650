"""RemoteBackend: OpenAI-compatible providers behind retries, backoff, circuit breakers and failover.

Each provider has one aiohttp session (one connection pool; provider.py says why not the openai SDK,
whose exception types it still raises). The body the client sent (validated, with the Sluice-only
fields removed and the model name mapped) is forwarded as is, and the answer's bytes are read without
building SDK objects: a relayed chunk costs one JSON parse. A stream is relayed a socket read at a
time: the outputs of one read go to the client together (`next_batch`), one write per read.

Each request's tries over its provider chain (rounds, backoff, breakers, Retry-After, failover and
the 429/503 of giving up) are a `TryChain` (tries.py); this module says what one try is: a chat or
completion answer, read whole (JSON) or as far as its first text (a stream), or an embeddings answer
(`RemoteBackend.embeddings`: the client's body without `truncate`, the model name mapped; the answer
must be a JSON object with a `data` list of one embedding per input, else the next provider is tried).
A stream is committed once a chunk with real text arrived (a role-only first chunk is not); before
that every failure is retried invisibly; after it a failure ends the stream with an error event.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import os
import random
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from engine import RequestOutput
from gateway import jsonio
from gateway.backends.base import Backend, ChoiceStream
from gateway.backends.remote.provider import (
    BadResponse,
    Provider,
    StreamDropped,
    UpstreamError,
    classify,
    transport_error,
)
from gateway.backends.remote.tries import TryChain
from gateway.errors import APIError, Failure
from gateway.messages import ChoiceOutput, ErrorOutput, GenerationRequest
from gateway.observability.metrics import Metrics
from gateway.openai.schema import ChatCompletionRequest
from gateway.settings import ProviderSettings, RoutingSettings

log = logging.getLogger("sluice.remote")

# Engine kinds whose chat API continues a partial answer with vLLM's `continue_final_message` (and take
# vLLM's other extras); llama-server continues a final assistant message as it is; "openai" cannot.
CONTINUES = ("vllm", "sglang", "sluice")

# Fields of Sluice's request models that providers do not know (extras of vLLM and Sluice).
SLUICE_ONLY_FIELDS = frozenset({"top_k", "stop_token_ids", "ignore_eos", "prompt_truncation", "cache_salt",
                                "repetition_penalty", "min_tokens", "guided_json", "continue_final_message",
                                "add_generation_prompt"})
# Fields of Sluice's embeddings request that providers do not know.
EMBEDDING_SLUICE_ONLY_FIELDS = frozenset({"truncate"})


def _json_body(status: int, content_type: str, content: bytes, key: str = "choices") -> dict[str, Any]:
    """The parsed body of a JSON answer, a JSON object with a `key` list; anything else is the
    provider's failure, not the caller's."""
    ctype = content_type.split(";")[0] or "no content type"
    try:
        body = jsonio.loads(content)
    except ValueError:
        raise BadResponse(f"answered {status} with a body that is not JSON ({ctype})") from None
    if not isinstance(body, dict):
        raise BadResponse(f"answered {status} with JSON that is not an object")
    if not isinstance(body.get(key), list):
        if isinstance(body.get("error"), (dict, str)):
            raise UpstreamError(body["error"])
        raise BadResponse(f"answered {status} without `{key}`")
    return body


def _input_count(inp: object) -> int | None:
    """How many vectors an embeddings `input` asks for (a string or one list of token ids: 1), or None
    when its shape says nothing (the provider refuses it)."""
    if isinstance(inp, str):
        return 1
    if isinstance(inp, list) and inp:
        return 1 if all(isinstance(x, int) for x in inp) else len(inp)
    return None


def _embeddings_body(status: int, content_type: str, content: bytes, inputs: int | None) -> dict[str, Any]:
    """The parsed body of an embeddings answer: a JSON object whose `data` holds one embedding object
    per input; anything else is the provider's failure (the next provider is tried)."""
    body = _json_body(status, content_type, content, "data")
    data = body["data"]
    if not all(isinstance(d, dict) and isinstance(d.get("embedding"), (list, str)) for d in data):
        raise BadResponse(f"answered {status} with a `data` item that is not an embedding")
    if inputs is not None and len(data) != inputs:
        raise BadResponse(f"answered {status} with {len(data)} embeddings for {inputs} inputs")
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


@dataclass
class _Parsed:
    """Accumulated facts of one upstream answer."""

    prompt_tokens: int | None = None
    cached_tokens: int = 0
    completion_tokens: int | None = None
    pending_finish: dict[int, str] = field(default_factory=dict)
    text_chunks: int = 0
    done: bool = False  # `data: [DONE]` seen
    text: list[str] = field(default_factory=list)  # choice 0's text as relayed (a resumed stream continues it)
    # A resumed stream: what the broken part(s) before it counted (the client is told the whole answer's usage).
    prior_completion: int = 0
    prior_prompt: int | None = None
    # Text the upstream sends back before its new text: llama-server streams a continued final assistant
    # message whole (the given part first), where vLLM sends only what it adds. Dropped as it comes.
    echo: str = ""


def _drop_echo(parsed: _Parsed, text: str) -> str:
    """`text` less the part of `parsed.echo` it starts with; the echo is over once a text goes past it."""
    n = len(os.path.commonprefix([text, parsed.echo]))
    parsed.echo = parsed.echo[n:] if n == len(text) else ""
    return text[n:]


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


class RemoteStream(ChoiceStream):
    """A chat or completion answer from the provider chain: the tries are a `TryChain`; a try posts the
    request and reads the answer (JSON: whole; a stream: up to its first text), the rest is relayed."""

    label = "remote"  # the `x-sluice-backend` prefix (an engine pool's stream says "engine")

    def __init__(self, backend: RemoteBackend, gen: GenerationRequest, chain: list[Provider]):
        self._gen = gen
        self._remote = backend
        self._continuation: tuple[str, int] | None = None  # (the answer so far, its tokens) once resumed
        self._tries: TryChain[TryResult] = TryChain(backend, gen.request_id, gen.model, gen.deadline, chain)
        self._backend = self.label  # "remote:<provider>" once a provider answers
        self._prompt_tokens: int | None = None
        self._it: AsyncGenerator[list[ChoiceOutput], None] = self._run()  # a list per upstream read
        self._ready: collections.deque[ChoiceOutput] = collections.deque()  # read, not yet handed out
        self._resp: aiohttp.ClientResponse | None = None
        self._closed = False
        self._times_first_token = True  # off for a continuation: its first text is not a request's

    @property
    def provider(self) -> Provider | None:
        """The provider being tried, then the one answering."""
        return self._tries.provider

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
        self._tries.release()

    # ---------------------------------------------------------------- the upstream body

    def _body(self, p: Provider) -> dict[str, Any]:
        api = self._gen.api
        assert api is not None  # the handler always passes the validated request
        body = api.model_dump(exclude_unset=True, exclude=self._dropped(p))
        body["model"] = p.settings.models[self._gen.model]
        if body.get("stream"):
            body["stream_options"] = {"include_usage": True}  # every token is counted
        if self._continuation is not None:
            partial, made = self._continuation
            body["messages"] = [*body["messages"], {"role": "assistant", "content": partial}]
            if p.settings.kind in CONTINUES:  # llama-server continues a final assistant message by default
                body["continue_final_message"] = True
                body["add_generation_prompt"] = False
            for k in ("max_tokens", "max_completion_tokens"):
                if isinstance(body.get(k), int):
                    body[k] = max(1, body[k] - made)
        return body

    def _dropped(self, p: Provider) -> set[str]:  # noqa: ARG002 (a pool stream decides per replica)
        """The request's fields `p` is not sent: Sluice's own (a provider does not know them)."""
        return set(SLUICE_ONLY_FIELDS)

    # ---------------------------------------------------------------- one try

    async def _attempt(self, p: Provider, deadline: float) -> TryResult:
        """One try for the TryChain: a failed one leaves no upstream response open. A stream's try returns
        at its first text: its time is the provider's first-token time (`Provider.first_token`)."""
        self._times_first_token = self._continuation is None
        t0 = time.monotonic()
        try:
            result = await self._try(p, deadline)
        except BaseException:
            await self._release_resp()
            raise
        if self._times_first_token and getattr(self._gen.api, "stream", False):
            p.first_token.observe(time.monotonic() - t0)
        return result

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
        echo = self._continuation[0] if self._continuation is not None and p.settings.kind == "llama-server" else ""
        parsed = _Parsed(echo=echo)
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
                        if idx == 0 and parsed.echo and text:
                            text = _drop_echo(parsed, text)
                        if text:
                            parsed.text_chunks += 1
                            if idx == 0:
                                parsed.text.append(text)
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
        if parsed.prior_prompt is not None:  # resumed: the prompt the client sent, not the continuation's
            parsed.prompt_tokens = parsed.prior_prompt
        elif parsed.prior_completion and parsed.prompt_tokens:  # its usage came too late: the continuation's
            parsed.prompt_tokens = max(0, parsed.prompt_tokens - parsed.prior_completion)  # less the partial answer
        self._prompt_tokens = parsed.prompt_tokens
        completion = parsed.completion_tokens if parsed.completion_tokens is not None else parsed.text_chunks
        completion += parsed.prior_completion
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

    # ---------------------------------------------------------------- the stream

    def _broken(self, p: Provider, parsed: _Parsed, what: str) -> ChoiceOutput:
        """The error that ends a stream broken mid-answer; its usage is what was relayed (what is billed)."""
        self._prompt_tokens = parsed.prior_prompt if parsed.prior_prompt is not None else parsed.prompt_tokens
        relayed = (parsed.completion_tokens or parsed.text_chunks) + parsed.prior_completion
        return ChoiceOutput(0, ErrorOutput(
            request_id=self._gen.request_id, finished=True, finish_reason="error",
            error=f"The provider `{p.name}` failed mid-stream ({what}); the answer is incomplete.",
            completion_tokens=relayed, prompt_tokens=self._prompt_tokens or 0,
            cached_tokens=parsed.cached_tokens, error_code="provider_error", failure=Failure.PROVIDER))

    async def _resume(self, p: Provider, parsed: _Parsed) -> tuple[Provider, TryResult] | None:
        """Continue a stream broken after its first text on another provider of the chain that can continue
        an answer (`kind` vllm, sglang, sluice or llama-server): the conversation plus the text relayed so
        far, left open (`continue_final_message`). One choice of plain text only: a grammar (tools, a
        response format) would start over, and several choices cannot be told apart. None: it cannot be
        (plain OpenAI-compatible APIs have no way to continue an answer)."""
        api = self._gen.api
        if (self._gen.endpoint != "chat" or self._gen.n != 1 or not isinstance(api, ChatCompletionRequest)
                or api.tools or (api.response_format is not None and api.response_format.type != "text")):
            return None
        others = [q for q in self._tries.chain if q is not p and q.settings.kind != "openai"]
        if not others:
            return None
        p.breaker.failure()
        made = (parsed.completion_tokens or parsed.text_chunks) + parsed.prior_completion
        await self._release_resp()
        self._tries.release()
        self._continuation = ("".join(parsed.text), made)
        self._tries = TryChain(self._remote, self._gen.request_id, self._gen.model, self._gen.deadline,
                               self._continue_order(others))
        try:
            q, result = await self._tries.run(self._attempt)
        except APIError as e:
            log.warning("nothing could continue %s: %s", self._gen.request_id, e.message)
            return None
        log.info("stream %s continued on %s after %d tokens", self._gen.request_id, q.name, made)
        result.parsed.prior_completion = made
        result.parsed.prior_prompt = parsed.prior_prompt if parsed.prior_prompt is not None else parsed.prompt_tokens
        result.parsed.text = parsed.text + result.parsed.text
        return q, result

    def _continue_order(self, others: list[Provider]) -> list[Provider]:
        """The order the continuing tries take: the chain's (an engine pool's: least busy first)."""
        return others

    async def _run(self) -> AsyncGenerator[list[ChoiceOutput], None]:
        p, result = await self._tries.run(self._attempt)
        self._backend = f"{self.label}:{p.name}"
        parsed = result.parsed
        try:
            yield result.outputs
            rest = result.rest
            while rest is not None:  # None: the whole answer is here (JSON, or a stream read to its end)
                try:
                    async for outs in rest:
                        yield outs
                    return
                except (Exception, StreamDropped) as e:  # committed: continued elsewhere, or an error event
                    f = classify(p, e)
                    what = f.message if f else type(e).__name__
                    log.warning("%s %s failed mid-stream for %s: %s", "provider" if self.label == "remote"
                                else "replica", p.name, self._gen.request_id, what)
                    resumed = await self._resume(p, parsed)
                if resumed is None:  # never silently: the client is told the answer is incomplete
                    yield [self._broken(p, parsed, what)]
                    return
                p, result = resumed
                self._backend = f"{self.label}:{p.name}"
                parsed = result.parsed
                yield result.outputs
                rest = result.rest
        finally:
            await self._release()


@dataclass
class RemoteAnswer:
    """A provider's whole JSON answer (embeddings): its body with "model" set back to the Sluice model
    name (usage as the provider counted it), and the provider that answered, which prices it."""

    body: dict[str, Any]
    provider: ProviderSettings

    @property
    def backend(self) -> str:
        """`remote:<provider>`, the `x-sluice-backend` header."""
        return f"remote:{self.provider.name}"

    @property
    def prompt_tokens(self) -> int | None:
        """The provider's `usage.prompt_tokens`, or None when it sent none."""
        usage = self.body.get("usage")
        n = usage.get("prompt_tokens") if isinstance(usage, dict) else None
        return int(n) if isinstance(n, (int, float)) and not isinstance(n, bool) else None


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

    def first_token_s(self, model: str) -> float | None:
        """The providers' learnt first-token time for the model (the fastest known): what a request sent
        to them after waiting elsewhere still has to pay."""
        known = [t for t in (p.first_token.estimate() for p in self.chain(model)) if t is not None]
        return min(known) if known else None

    def on_attempt(self, p: Provider, outcome: str, seconds: float) -> None:
        if self.metrics is not None:
            self.metrics.remote_attempt(p.name, outcome, seconds)

    async def submit(self, gen: GenerationRequest) -> ChoiceStream:
        chain = self.chain(gen.model)
        if not chain:
            raise APIError(404, f"The model `{gen.model}` does not exist.", param="model", code="model_not_found")
        return RemoteStream(self, gen, chain)

    async def embeddings(self, request_id: str, model: str, body: dict[str, Any],
                         deadline: float | None = None, chain: list[Provider] | None = None) -> RemoteAnswer:
        """`POST /v1/embeddings` through the provider chain of `model`: `body` is the client's request
        (its Sluice-only `truncate` is not sent; `model` is mapped to each provider's name), `deadline`
        the wall-clock time (`time.time()`) after which it is no longer wanted, as a chat request's.
        Tried, retried and failed over as chat is (a TryChain): a provider's 400/413/422 is raised as
        an APIError with its message, param and code; giving up raises the 429/503 with Retry-After;
        an unknown model is a 404 `model_not_found`. `chain`: these providers in this order instead of the
        model's chain (an engine pool's replicas, the one it admitted the request to first)."""
        chain = self.chain(model) if chain is None else chain
        if not chain:
            raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")
        sent = {k: v for k, v in body.items() if k not in EMBEDDING_SLUICE_ONLY_FIELDS}
        inputs = _input_count(sent.get("input"))

        async def attempt(p: Provider, until: float) -> dict[str, Any]:
            timeout = max(0.05, min(p.settings.timeout_s, until - time.monotonic()))
            resp = await p.post("embeddings", jsonio.dumps({**sent, "model": p.settings.models[model]}), timeout)
            content = await p.read(resp)
            return _embeddings_body(resp.status, resp.headers.get("content-type", ""), content, inputs)

        tries: TryChain[dict[str, Any]] = TryChain(self, request_id, model, deadline, chain)
        try:
            p, answer = await tries.run(attempt)
        finally:
            tries.release()  # the whole answer is read: the provider's slot is free
        answer["model"] = model
        return RemoteAnswer(answer, p.settings)

    def responses_chain(self, model: str) -> list[Provider]:
        """The providers of `model` that serve `/v1/responses` natively (`responses = true`)."""
        return [p for p in self.chain(model) if p.settings.responses]

    async def responses(self, request_id: str, model: str, body: dict[str, Any],
                        deadline: float | None = None) -> RemoteAnswer:
        """`POST /v1/responses` (JSON) through the providers of `model` that serve it natively, tried,
        retried and failed over as embeddings are. `body` is sent as is but for `model` (each provider's
        name); the answer's `model` is set back to Sluice's."""
        chain = self.responses_chain(model)
        if not chain:
            raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")

        async def attempt(p: Provider, until: float) -> dict[str, Any]:
            timeout = max(0.05, min(p.settings.timeout_s, until - time.monotonic()))
            resp = await p.post("responses", jsonio.dumps({**body, "model": p.settings.models[model]}), timeout)
            content = await p.read(resp)
            return _json_body(resp.status, resp.headers.get("content-type", ""), content, key="output")

        tries: TryChain[dict[str, Any]] = TryChain(self, request_id, model, deadline, chain)
        try:
            p, answer = await tries.run(attempt)
        finally:
            tries.release()
        answer["model"] = model
        return RemoteAnswer(answer, p.settings)

    async def close(self) -> None:
        for p in self.providers:
            try:
                await p.close()
            except Exception as e:  # shutting down: a connection pool that fails to close is not news
                log.debug("closing provider %s failed: %s", p.name, e)
