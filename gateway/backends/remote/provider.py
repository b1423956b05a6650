"""One remote provider: its HTTP client, breaker, concurrency and Retry-After state, and how a failed
try is classified (what counts against the breaker, what is retried, what is the caller's fault).

The call is a plain `aiohttp.ClientSession` per provider (one connection pool), not the openai SDK:
the SDK's request machinery (httpx2 Request/Headers/URL objects, option copies, auth wrappers and a
log line per call) cost about 0.5 ms of CPU per request, half of the gateway's whole cost on a remote
route, for work aiohttp does in a tenth of that (bench/remote_overhead.py, bench/profile_remote.py).
The SDK still defines the errors: a non-2xx answer raises the SDK's exception for its status (built as
the SDK builds it: `RateLimitError`, `InternalServerError`, ... with the parsed error body) and a
transport failure `openai.APIConnectionError` / `APITimeoutError` chained to the aiohttp error, so
`classify` and the retry, breaker and failover rules read the same exceptions as before.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import logging
import time
import urllib.request
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import httpx2
import openai

from gateway.backends.latency import FirstTokenTimes
from gateway.backends.remote.breaker import CircuitBreaker
from gateway.settings import ProviderSettings, RoutingSettings

log = logging.getLogger("sluice.remote")

CLIENT_FAULT_STATUS = frozenset({400, 413, 422})
# By GenerationRequest.endpoint, and "embeddings" (RemoteBackend.embeddings).
PATHS = {"chat": "/chat/completions", "completion": "/completions", "embeddings": "/embeddings",
         "responses": "/responses"}
KEEPALIVE_S = 5.0  # an idle upstream connection is closed after this (httpx's default, as before)

try:
    _VERSION = importlib.metadata.version("sluice")
except importlib.metadata.PackageNotFoundError:  # run from a source tree that is not installed
    _VERSION = "0"
USER_AGENT = f"sluice/{_VERSION}"

# aiohttp's errors as the SDK's aiohttp transport mapped them to httpx2's (the most specific wins), for
# failures while a stream's body is read: `classify` and the logs name these types.
_TRANSPORT_ERRORS: tuple[tuple[type[BaseException], type[httpx2.TransportError]], ...] = (
    (aiohttp.ClientPayloadError, httpx2.ReadError),
    (aiohttp.ClientConnectorError, httpx2.ConnectError),
    (aiohttp.SocketTimeoutError, httpx2.ReadTimeout),
    (aiohttp.ServerTimeoutError, httpx2.TimeoutException),
    (aiohttp.ClientConnectionError, httpx2.ConnectTimeout),
)


def transport_error(e: BaseException) -> BaseException:
    """The httpx2 error the SDK's transport raised for an aiohttp error met while reading a body
    (chained to it), or `e` itself when there is none."""
    for aio, mapped in _TRANSPORT_ERRORS:
        if isinstance(e, aio):
            err = mapped(str(e))
            err.__cause__ = e
            return err
    if isinstance(e, TimeoutError):
        err = httpx2.ReadTimeout(str(e) or "timed out")
        err.__cause__ = e
        return err
    return e


def _env_proxy(url: str) -> str | None:
    """The proxy the environment (HTTPS_PROXY, HTTP_PROXY, ALL_PROXY, NO_PROXY) sets for `url`, as the
    SDK's client honoured it; looked up once, not per request."""
    u = urlsplit(url)
    proxies = urllib.request.getproxies()
    proxy = proxies.get(u.scheme) or proxies.get("all")
    if not proxy or urllib.request.proxy_bypass(u.hostname or ""):
        return None
    return proxy


def status_error(status: int, headers: Any, content: bytes, url: str) -> openai.APIStatusError:
    """The SDK's exception for a non-2xx answer, built as the SDK builds it (message, parsed body)."""
    response = httpx2.Response(status, headers=headers, content=content, request=httpx2.Request("POST", url))
    err_msg = f"Error code: {status}"
    text = content.decode("utf-8", "replace").strip()
    body: object = text
    try:
        body = json.loads(text)
    except ValueError:
        pass
    else:
        err = body.get("error", body) if isinstance(body, dict) else None
        message = err.get("message") if isinstance(err, dict) else None
        if isinstance(message, str) and message:
            err_msg += f" - {message}"
    data = body.get("error", body) if isinstance(body, dict) else body
    cls: type[openai.APIStatusError] = {
        400: openai.BadRequestError, 401: openai.AuthenticationError, 403: openai.PermissionDeniedError,
        404: openai.NotFoundError, 409: openai.ConflictError, 422: openai.UnprocessableEntityError,
        429: openai.RateLimitError}.get(status, openai.InternalServerError if status >= 500 else openai.APIStatusError)
    return cls(err_msg, response=response, body=data)


class Provider:
    def __init__(self, settings: ProviderSettings, routing: RoutingSettings):
        self.settings = settings
        self.name = settings.name
        self.breaker = CircuitBreaker(routing.breaker_failures, routing.breaker_cooldown_s)
        self.in_flight = 0
        self.first_token = FirstTokenTimes()  # sending a stream to its first text (learnt: latency.py)
        self.not_before = 0.0  # monotonic time before which its Retry-After asks us not to call
        self.not_before_reason = "retry_after"  # "rate_limited" when that Retry-After came with a 429
        # A configuration problem (an unset key, credentials refused): shown in /ready until it answers.
        self.config_error: str | None = settings.key_problem()
        if self.config_error:
            log.warning("provider %s: %s; it will be called without an API key and will likely refuse "
                        "(HTTP 401)", self.name, self.config_error)
        base = settings.base_url.rstrip("/")
        self.urls = {endpoint: base + path for endpoint, path in PATHS.items()}
        self.headers = {"Authorization": f"Bearer {settings.api_key() or 'missing'}",
                        "Content-Type": "application/json", "Accept": "application/json",
                        "User-Agent": USER_AGENT}
        self.proxy = _env_proxy(base)
        self._session: aiohttp.ClientSession | None = None  # made on first use, inside the event loop

    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # One pool of at most max_concurrent connections; redirects stay off (as with the SDK).
            connector = aiohttp.TCPConnector(limit=self.settings.max_concurrent, limit_per_host=0,
                                             keepalive_timeout=KEEPALIVE_S)
            self._session = aiohttp.ClientSession(connector=connector)
        return self._session

    async def post(self, endpoint: str, body: bytes, timeout: float | None = None) -> aiohttp.ClientResponse:
        """POST `body` (JSON) to the endpoint (a key of PATHS); the response once
        it answered 2xx, its body unread (the caller releases it). A status >= 400 raises the SDK's
        exception for it; a failure to connect or to get the answer's head raises `openai.APIConnectionError`
        (`APITimeoutError` for a timeout) chained to the aiohttp error. `timeout` (default the
        provider's `timeout_s`) bounds the connect and each read, as the SDK's did."""
        url = self.urls[endpoint]
        t = self.settings.timeout_s if timeout is None else timeout
        try:
            resp = await self.session().post(
                url, data=body, headers=self.headers, proxy=self.proxy, allow_redirects=False,
                timeout=aiohttp.ClientTimeout(total=None, connect=t, sock_connect=t, sock_read=t))
        except (TimeoutError, aiohttp.ClientError) as e:
            raise _api_connection_error(e, url) from e
        if resp.status >= 400:
            try:
                content = await resp.read()
            except (TimeoutError, aiohttp.ClientError):
                content = b""
            finally:
                resp.release()
            raise status_error(resp.status, resp.raw_headers, content, url)
        return resp

    @staticmethod
    async def read(resp: aiohttp.ClientResponse) -> bytes:
        """The whole body of a JSON answer (the connection then goes back to the pool); a transport
        failure raises as in `post`."""
        try:
            return await resp.read()
        except (TimeoutError, aiohttp.ClientError) as e:
            raise _api_connection_error(e, str(resp.url)) from e
        finally:
            resp.release()

    def usable(self, now: float) -> bool:
        return self.unavailable(now) is None

    def unavailable(self, now: float) -> str | None:
        """Why this provider cannot be tried now, or None."""
        if not self.breaker.available():
            return "misconfigured" if self.config_error else "circuit_open"
        if self.in_flight >= self.settings.max_concurrent:
            return "busy"
        if now < self.not_before:
            return self.not_before_reason
        return None

    def hold(self, seconds: float, reason: str) -> None:
        """Not called for `seconds` (a Retry-After it gave us)."""
        self.not_before = max(self.not_before, time.monotonic() + seconds)
        self.not_before_reason = reason

    def status(self) -> dict[str, Any]:
        """For /ready."""
        now = time.monotonic()
        out: dict[str, Any] = {"circuit": self.breaker.state, "in_flight": self.in_flight,
                               "error": self.config_error}
        if now < self.not_before:
            out["retry_after_s"] = round(self.not_before - now, 3)
        return out

    def wait_hint(self, now: float) -> float:
        """Seconds until this provider could be tried again."""
        return max(self.not_before - now, self.breaker.retry_in(), 0.0)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


def _api_connection_error(e: BaseException, url: str) -> openai.APIConnectionError:
    request = httpx2.Request("POST", url)
    if isinstance(e, aiohttp.ServerTimeoutError) or not isinstance(e, aiohttp.ClientError):
        return openai.APITimeoutError(request=request)
    return openai.APIConnectionError(request=request)


@dataclass
class AttemptFailure:
    provider: str
    # "rate_limited" | "server_error" | "timeout" | "connection" | "misconfigured" | "dropped" |
    # "bad_response" (a body that is not JSON/SSE) | "error" (anything else)
    kind: str
    message: str
    status: int | None = None
    retry_after: float | None = None


class RoundFailed(Exception):
    def __init__(self, failures: list[AttemptFailure], wait_hint: float | None, final: bool = False):
        super().__init__("; ".join(f"{f.provider}: {f.message}" for f in failures) or "no provider available")
        self.failures = failures
        self.wait_hint = wait_hint
        self.final = final  # no later round can do better: answer now


def retry_after_seconds(headers: Any) -> float | None:
    if headers is None:
        return None
    for name in ("retry-after-ms", "retry-after"):
        v = headers.get(name)
        if v is None:
            continue
        try:
            s = float(v)
            return s / 1000 if name == "retry-after-ms" else s
        except ValueError:
            try:
                import email.utils

                return max(0.0, email.utils.parsedate_to_datetime(v).timestamp() - time.time())
            except Exception:
                return None
    return None


def _aiohttp_cause(e: BaseException) -> BaseException | None:
    """The aiohttp error behind an SDK/httpx2 error, if any. `transport_error` maps every
    `aiohttp.ClientConnectionError` (a refused connection, a server that hung up) to httpx2's
    `ConnectTimeout`, as the SDK's aiohttp transport did; the original tells a timeout from a
    connection failure."""
    seen = 0
    while e is not None and seen < 8:
        if isinstance(e, aiohttp.ClientError):
            return e
        e = e.__cause__ or e.__context__  # type: ignore[assignment]
        seen += 1
    return None


def classify(p: Provider, e: BaseException) -> AttemptFailure | None:
    """A retryable/failover-able failure, or None when the error is the caller's (re-raised as 4xx)."""
    if isinstance(e, (openai.APIConnectionError, httpx2.TransportError)):  # APITimeoutError included
        cause = _aiohttp_cause(e)
        if cause is not None:
            if isinstance(cause, (aiohttp.ServerTimeoutError, asyncio.TimeoutError, TimeoutError)):
                return AttemptFailure(p.name, "timeout", "timed out")
            # the SDK's error type (before any byte), or the transport's (mid-stream)
            name = "APIConnectionError" if isinstance(e, openai.APIError) else type(e).__name__
            return AttemptFailure(p.name, "connection", f"connection failed ({name})")
    if isinstance(e, openai.APIStatusError):
        st = e.status_code
        ra = retry_after_seconds(e.response.headers)
        msg = f"HTTP {st}"
        if st in CLIENT_FAULT_STATUS:
            return None
        if st == 429:
            return AttemptFailure(p.name, "rate_limited", msg, st, ra)
        if st in (401, 403):
            env = p.settings.api_key_env
            hint = p.settings.key_problem() or (f"check the key in {env} (api_key_env)" if env
                                                else "set api_key_env")
            return AttemptFailure(p.name, "misconfigured", f"{msg}: the provider refused our credentials; {hint}", st)
        if st == 404:
            return AttemptFailure(p.name, "misconfigured", f"{msg}: check the provider's model name and base_url", st)
        return AttemptFailure(p.name, "server_error", msg, st, ra)  # 5xx, 408, 409, and any other status
    if isinstance(e, (openai.APITimeoutError, httpx2.TimeoutException, asyncio.TimeoutError, TimeoutError)):
        return AttemptFailure(p.name, "timeout", "timed out")
    if isinstance(e, (openai.APIConnectionError, httpx2.TransportError, ConnectionError)):
        return AttemptFailure(p.name, "connection", f"connection failed ({type(e).__name__})")
    if isinstance(e, StreamDropped):
        return AttemptFailure(p.name, "dropped", "the stream ended early")
    if isinstance(e, UpstreamError):
        return AttemptFailure(p.name, "server_error", f"an error in a 200 answer ({e})"[:300])
    if isinstance(e, BadResponse):
        return AttemptFailure(p.name, "bad_response", str(e))
    if isinstance(e, json.JSONDecodeError):
        return AttemptFailure(p.name, "bad_response", f"an answer that is not JSON ({e.msg})")
    # Anything else (an SDK or transport error no rule above knows, a bug): a failure of this provider.
    return AttemptFailure(p.name, "error", f"{type(e).__name__}: {e}"[:300])


class StreamDropped(Exception):
    pass


class BadResponse(Exception):
    """A 2xx answer that is not what an OpenAI-compatible API sends (an HTML page from a proxy, a body
    that is not JSON, a stream line that is not JSON)."""


class UpstreamError(Exception):
    def __init__(self, err: Any):
        super().__init__(str(err))
