"""TryChain: one request's tries over its provider chain, in rounds, until one provider answers.

What a try does is the caller's (`attempt(provider, deadline)`: a chat answer up to its first text, an
embeddings answer); the rounds, the waits between them, the breakers, the Retry-After holds, the
in-flight counts and the errors the client gets when every try failed are this module's.

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
The provider that answered keeps its in-flight slot (a stream still reads from it) until `release()`.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Generic, TypeVar

import openai
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, stop_after_attempt
from tenacity.stop import stop_base

from gateway.backends.remote.provider import AttemptFailure, Provider, RoundFailed, classify
from gateway.errors import APIError

if TYPE_CHECKING:
    from gateway.backends.remote.backend import RemoteBackend

log = logging.getLogger("sluice.remote")

T = TypeVar("T")

# Why a provider was not tried in a round (Provider.unavailable's reasons), as the 503 says it.
_SKIPPED = {"circuit_open": "circuit open", "busy": "at its concurrency limit",
            "rate_limited": "inside its Retry-After", "retry_after": "inside its Retry-After",
            "misconfigured": "misconfigured"}


def client_error(e: openai.APIStatusError) -> APIError:
    """A provider's 400/413/422 as the client gets it: its status, message, param and code."""
    body = e.body if isinstance(e.body, dict) else {}
    err = body.get("error", body) if isinstance(body, dict) else {}
    if not isinstance(err, dict):
        err = {}
    return APIError(e.status_code, str(err.get("message") or e.message), param=err.get("param"),
                    code=err.get("code"))


class stop_when(stop_base):
    """A tenacity stop condition from a predicate (so it composes with `|`)."""

    def __init__(self, predicate: Callable[[RetryCallState], bool]):
        self.predicate = predicate

    def __call__(self, retry_state: RetryCallState) -> bool:
        return self.predicate(retry_state)


class TryChain(Generic[T]):
    """The tries of one request (`run`, called once) over `chain`, the providers serving `model`.

    `deadline` is the caller's wall-clock (`time.time()`) deadline, or None; the tries also end after
    `routing.request_timeout_s`. `provider` is the provider being tried, then the one that answered;
    it holds an in-flight slot until `release()` (idempotent), which the caller must call."""

    def __init__(self, remote: RemoteBackend, request_id: str, model: str, deadline: float | None,
                 chain: list[Provider]):
        self._remote = remote
        self.request_id = request_id
        self.model = model
        self.deadline = deadline
        self.chain = chain
        self.provider: Provider | None = None
        self._holding = False  # counted in self.provider.in_flight
        self._excluded: set[Provider] = set()  # refused our configuration: not retried for this request
        self._last_kind: dict[str, str] = {}  # provider -> its last failure or reason it was skipped
        self._failures: list[AttemptFailure] = []  # every failed try of this request

    def release(self) -> None:
        """Give back the in-flight slot of the provider tried or answering, if it holds one."""
        if self.provider is not None and self._holding:
            self._holding = False
            self.provider.in_flight -= 1

    async def run(self, attempt: Callable[[Provider, float], Awaitable[T]]) -> tuple[Provider, T]:
        """Tries until one `attempt(provider, deadline)` returns (`deadline`: time.monotonic() by which
        the try must be over); the provider and what it returned. An `attempt` cleans up after itself
        when it raises. Raises the provider's 400/413/422 as an APIError, else the 429/503 of giving up."""
        r = self._remote.routing
        start = time.monotonic()
        deadline = start + r.request_timeout_s
        if self.deadline is not None:  # a wall-clock deadline set by the caller
            deadline = min(deadline, start + max(0.0, self.deadline - time.time()))

        def wait_after(n: int, e: BaseException | None) -> float:
            """The wait after round `n` (1-based) failed with `e`."""
            hint = e.wait_hint if isinstance(e, RoundFailed) else None
            if hint:
                return hint + 0.005  # just past the Retry-After (or cool-down) it waits out
            cap = min(r.backoff_max_s, r.backoff_base_s * 2 ** (n - 1))
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
            return await self._round(attempt, deadline)
        except RoundFailed as e:
            last = e
        sleep = wait_after(1, last)
        if r.max_attempts <= 1 or give_up(last, sleep):
            raise self._give_up(last)
        await asyncio.sleep(sleep)

        def outcome(rs: RetryCallState) -> BaseException | None:
            return rs.outcome.exception() if rs.outcome else None

        try:  # rounds 2.. (tenacity's attempt k is round k + 1)
            async for retry in AsyncRetrying(
                    stop=stop_after_attempt(r.max_attempts - 1) | stop_when(
                        lambda rs: give_up(outcome(rs), rs.upcoming_sleep)),
                    wait=lambda rs: wait_after(rs.attempt_number + 1, outcome(rs)),
                    retry=retry_if_exception_type(RoundFailed), reraise=True):
                with retry:
                    return await self._round(attempt, deadline)
        except RoundFailed as e:
            last = e
        raise self._give_up(last)

    def _live(self) -> list[Provider]:
        """Providers this request may still wait for: not excluded by a configuration error."""
        return [p for p in self.chain if p not in self._excluded
                and not (p.config_error and not p.breaker.available())]

    async def _round(self, attempt: Callable[[Provider, float], Awaitable[T]], deadline: float) -> tuple[Provider, T]:
        failures: list[AttemptFailure] = []
        tried = 0
        b = self._remote
        for p in b.order(self.chain):
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
            t0 = time.monotonic()
            try:
                result = await attempt(p, deadline)
            except asyncio.CancelledError:
                p.breaker.release()
                self.release()
                raise
            except Exception as e:
                self.release()
                self.provider = None
                f = classify(p, e)
                if f is None:  # the caller's fault (400/413/422): answer it, count no failure
                    p.breaker.release()
                    if isinstance(e, openai.APIStatusError):
                        raise client_error(e) from None
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
        rid = self.request_id
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
        names = ", ".join(p.name for p in self.chain)
        live = self._live()
        model = self.model
        if not live:  # every provider refused our configuration: say so, not "overloaded"
            last = {f.provider: f.message for f in self._failures}
            errors = "; ".join(f"{p.name}: {p.config_error or last.get(p.name) or 'misconfigured'}"
                               for p in self.chain)
            waits = [p.breaker.retry_in() for p in self.chain if p.breaker.retry_in() > 0]
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
