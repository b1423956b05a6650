"""One remote provider: its client, breaker, concurrency and Retry-After state, and how a failed try
is classified (what counts against the breaker, what is retried, what is the caller's fault).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import httpx2
import openai

from gateway.backends.remote.breaker import CircuitBreaker
from gateway.settings import ProviderSettings, RoutingSettings

log = logging.getLogger("sluice.remote")

CLIENT_FAULT_STATUS = frozenset({400, 413, 422})


class Provider:
    def __init__(self, settings: ProviderSettings, routing: RoutingSettings):
        self.settings = settings
        self.name = settings.name
        self.breaker = CircuitBreaker(routing.breaker_failures, routing.breaker_cooldown_s)
        self.in_flight = 0
        self.not_before = 0.0  # monotonic time before which its Retry-After asks us not to call
        self.not_before_reason = "retry_after"  # "rate_limited" when that Retry-After came with a 429
        # A configuration problem (an unset key, credentials refused): shown in /ready until it answers.
        self.config_error: str | None = settings.key_problem()
        if self.config_error:
            log.warning("provider %s: %s; it will be called without an API key and will likely refuse "
                        "(HTTP 401)", self.name, self.config_error)
        limits = httpx2.Limits(max_connections=settings.max_concurrent,
                               max_keepalive_connections=settings.max_concurrent)
        # The SDK's aiohttp transport: aiohttp's C parser and connector instead of httpcore's pure-Python
        # h11 state machine, header validation and pool bookkeeping (measured in bench/remote_overhead.py).
        # Redirects stay off, as with a plain httpx client.
        self.http = openai.DefaultAioHttpClient(limits=limits, timeout=settings.timeout_s, follow_redirects=False)
        self.client = openai.AsyncOpenAI(api_key=settings.api_key() or "missing", base_url=settings.base_url,
                                         max_retries=0, timeout=settings.timeout_s, http_client=self.http)

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
        await self.client.close()


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
    """The aiohttp error behind an SDK/httpx2 error, if any. The aiohttp transport maps every
    `aiohttp.ClientConnectionError` (a refused connection, a server that hung up) to httpx2's
    `ConnectTimeout`; the original tells a timeout from a connection failure."""
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
