"""Admission's HTTP side: authentication, per-key limits before any work on a request, and
`GET /v1/usage` (the calling key's totals). `setup` registers them on the app, in this order.

Metered requests (the generation routes: the ledger records each) are refused with 503
`usage_unavailable` while spend cannot be recorded (the usage ledger or the Redis totals failing: they log
it once), so that the rows nobody can write are at most those of the requests already in flight."""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.typedefs import Handler

from gateway.admission.auth import KEY_NAME, TIER_KEY, make_auth_middleware
from gateway.admission.keys import KeyStore
from gateway.admission.ledger import UsageLedger
from gateway.admission.limits import Limiter
from gateway.admission.refusals import budget_spent, usage_unavailable
from gateway.admission.usage import ANON, SpendUnavailable, UsageStore
from gateway.errors import APIError
from gateway.observability.metrics import Metrics

LIMITED_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})


def limits_middleware(limiter: Limiter, usage: UsageStore, metrics: Metrics,
                      ledger: UsageLedger | None = None) -> web.middleware:  # type: ignore[valid-type]
    @web.middleware
    async def limits(request: web.Request, handler: Handler) -> web.StreamResponse:
        """Spend recordable, then per-key requests/tokens per minute and budget, before any work."""
        if request.method == "POST" and request.path in LIMITED_PATHS:
            if not await usage.recover_now() or (ledger is not None and not await ledger.recover_now()):
                raise usage_unavailable()
            key = request.get(KEY_NAME)
            tier = request.get(TIER_KEY, "standard")
            lim = limiter.limits_for(key, tier)
            try:
                spent = await usage.spent(key) if lim.budget is not None else 0.0
            except SpendUnavailable:
                raise usage_unavailable() from None
            v = await limiter.admit(key, tier, spent)
            if not v.ok:
                metrics.rate_limited.labels(key or ANON, v.reason).inc()
                if v.reason == "budget":
                    raise budget_spent(float(v.limit or 0.0))
                what = "requests" if v.reason == "rpm" else "tokens"
                raise APIError(429, f"Rate limit reached: {v.limit} {what} per minute for this key. "
                                    f"Retry in {math.ceil(v.retry_after or 1)} s.",
                               type="rate_limit_error", code="rate_limit_exceeded", retry_after=v.retry_after)
        return await handler(request)

    return limits


def usage_handler(usage: UsageStore) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def get_usage(request: web.Request) -> web.Response:
        """GET /v1/usage: the calling key's totals (all time), by model and by backend."""
        key = request.get(KEY_NAME)
        try:
            totals = await usage.totals(key)
        except SpendUnavailable:
            raise usage_unavailable() from None
        return web.json_response({"object": "usage", "key": key if key is not None else ANON, **totals})

    return get_usage


def setup(app: web.Application, *, keys: KeyStore, anonymous_tier: str, limiter: Limiter, usage: UsageStore,
          metrics: Metrics, ledger: UsageLedger | None = None) -> None:
    app.middlewares.append(make_auth_middleware(keys, anonymous_tier))
    app.middlewares.append(limits_middleware(limiter, usage, metrics, ledger))
    app.router.add_get("/v1/usage", usage_handler(usage))
