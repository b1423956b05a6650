"""The router: picks the backend of each request, local engine or remote provider chain.

Local first:
  * a request prepared as a relay (`Target.RELAY`: not tokenized here) goes remote: a model only
    providers serve (`remote_only`), any request when no engine worker is ready (`no_worker`), or a
    part the local model cannot serve (`capability`);
  * a model served both ways goes remote when the estimated queue wait for the request's tier exceeds
    `tiers.<tier>.max_queue_wait_ms` (`queue_wait`; the estimate of the time to its first token, the wait
    for a slot and the prefill ahead of it: routing/estimate.py) or the tier's queue is full (`queue_full`);
  * a model only the local engine serves queues (`local_only`), or with `routing.refuse_past_target` is
    refused at once with 429 + Retry-After when that estimate is past the tier's target (`refused_late`);
  * a local request still queued at `START_BY` of its tier's target (the estimate was wrong, or higher
    tiers arrived after it) is taken back out of the queue: to the providers (`queue_late`), or, with
    `refuse_past_target` and none, a 429 (`refused_late`);
  * a local failure before the first token is retried remotely (`local_failed`, routing/fallback.py).
With an engine pool for the model (`[[engines]]`, backends/pool/): the embedded engine takes it while it has
a free slot and nothing queued; else it waits, in tier order, for room on a replica (`pool`), at most
the tier's target, then goes to the embedded engine's queue or a provider (`queue_wait`) or, with
neither, is refused at once with 429 `engines_busy`; every replica failing before the first token
moves it on the same way (`pool_failed`, routing/fallback.py).
`pro` has nothing of `standard` ahead of it and a larger target, so it stays local longest. Each
decision is counted with its reason (`RouteReason`, routing/reasons.py: the words in parentheses here)
in `sluice_route_decisions_total` and logged (remote ones at INFO); every answer is
accounted (routing/accounting.py) and carries `x-sluice-backend: local|remote:<provider>`.
"""

from __future__ import annotations

import logging
import math
import time

from gateway.backends.base import Backend, ChoiceStream
from gateway.backends.pool.backend import PoolBackend, PoolBusy
from gateway.backends.remote.backend import RemoteBackend
from gateway.errors import APIError
from gateway.messages import GenerationRequest, Target
from gateway.observability.metrics import Metrics
from gateway.openai.schema import engine_only_fields
from gateway.queue.base import QueueFull
from gateway.routing.accounting import Accountant
from gateway.routing.capacity import LocalSide
from gateway.routing.estimate import WaitEstimator
from gateway.routing.fallback import FallbackStream, PoolFallbackStream
from gateway.routing.reasons import RouteReason
from gateway.settings import RoutingSettings

log = logging.getLogger("sluice.router")

BACKEND_HEADER = "x-sluice-backend"
# A local request still queued at this share of its tier's TTFT target is taken back (a provider, or a 429
# with refuse_past_target): what is left covers the provider's first token, or the prefill once started.
START_BY = 0.8


class Router(Backend):
    def __init__(self, *, local: Backend, remote: RemoteBackend | None, side: LocalSide,
                 estimator: WaitEstimator, accountant: Accountant, routing: RoutingSettings, metrics: Metrics,
                 pool: PoolBackend | None = None):
        self.local = local
        self.remote = remote
        self.pool = pool
        self.side = side
        self.estimator = estimator
        self.accountant = accountant
        self.routing = routing
        self.metrics = metrics

    def serves_remotely(self, model: str) -> bool:
        """Something besides the local engine serves the model: a provider or an engine pool."""
        return self._has_providers(model) or self._pooled(model)

    def _has_providers(self, model: str) -> bool:
        return self.remote is not None and bool(self.remote.chain(model))

    def _pooled(self, model: str) -> bool:
        return self.pool is not None and bool(self.pool.chain(model))

    def remote_models(self) -> list[str]:
        out = self.remote.models() if self.remote is not None else []
        return out + [m for m in (self.pool.models() if self.pool is not None else []) if m not in out]

    async def submit(self, gen: GenerationRequest) -> ChoiceStream:
        """Hold the request's worst-case cost against its key's budget (for every backend it may take),
        then route it; the hold is settled when the answer is accounted, or released here on failure."""
        local = gen.target is Target.LOCAL and gen.needs_remote is None
        chain = self.remote.chain(gen.model) if self.remote is not None else []
        await self.accountant.reserve(gen, local=local, providers=[p.settings for p in chain])
        try:
            return await self._route(gen)
        except BaseException:
            await self.accountant.release(gen)
            raise

    async def _route(self, gen: GenerationRequest) -> ChoiceStream:
        t0 = time.monotonic()
        extras = engine_only_fields(gen.api)  # only an engine applies them: never a provider
        if gen.needs_remote is not None:  # a capability the local model lacks (an image part, ...)
            self._no_provider_for(extras, "needs a provider (it sends " + gen.needs_remote + ")")
            return await self._remote(gen, RouteReason.CAPABILITY, t0)
        if self._pooled(gen.model) and not gen.batch:
            return await self._pooled_route(gen, t0)
        if gen.target is Target.RELAY:  # not tokenized here: the local side cannot take it
            reason = RouteReason.REMOTE_ONLY if gen.model != self.side.local_model() else RouteReason.NO_WORKER
            if extras and reason is RouteReason.NO_WORKER:
                raise APIError(503, f"No engine worker is ready, and `{extras[0]}` is applied only by an engine, "
                                    "not by the remote providers; retry shortly.", code="not_ready", retry_after=1)
            self._no_provider_for(extras, "is served only by remote providers")
            return await self._remote(gen, reason, t0)
        if not self._has_providers(gen.model):
            if not self.routing.refuse_past_target or gen.batch:
                return self._local(await self.local.submit(gen), gen, t0, RouteReason.LOCAL_ONLY)
            await self._refuse_if_late(gen)
            return self._local(self._start_by(await self.local.submit(gen), gen, t0), gen, t0,
                               RouteReason.LOCAL_ONLY)
        if gen.batch:  # runs on idle local room; a refusal (queue full) is its runner's to retry later
            return self._local(await self.local.submit(gen), gen, t0, RouteReason.BATCH)
        if extras:  # a provider would drop the field: the local engine, however long its queue
            stream = await self.local.submit(gen)
            return self._local(stream, gen, t0, RouteReason.ENGINE_FIELD)
        if not self.side.local_ready():
            return await self._remote(gen, RouteReason.NO_WORKER, t0)
        target = self.estimator.tier_target_s(gen.tier)
        if self.routing.overflow and target is not None:
            est = await self.estimator.estimate_wait(gen.tier, len(gen.prompt_token_ids))
            if est > target:
                return await self._remote(gen, RouteReason.QUEUE_WAIT, t0, est)
        try:
            stream = await self.local.submit(gen)
        except QueueFull:
            return await self._remote(gen, RouteReason.QUEUE_FULL, t0)
        if self.routing.local_retry_remote and self.remote is not None:
            start_by = t0 + START_BY * target if self.routing.overflow and target is not None else None
            stream = FallbackStream(gen, stream, self.remote, self.metrics, start_by)
        return self._local(stream, gen, t0, RouteReason.LOCAL)

    def _start_by(self, stream: ChoiceStream, gen: GenerationRequest, t0: float) -> ChoiceStream:
        """`refuse_past_target` on a model only the local engine serves: a request still queued at START_BY
        of its tier's target ends with a 429 (routing/fallback.py) rather than starting past it."""
        target = self.estimator.tier_target_s(gen.tier)
        if target is None:
            return stream
        return FallbackStream(gen, stream, None, self.metrics, start_by=t0 + START_BY * target)

    @staticmethod
    def _no_provider_for(extras: list[str], why: str) -> None:
        """A 400 naming the first engine-only field when the request can only go to a provider."""
        if extras:
            raise APIError(400, f"`{extras[0]}` is applied only by an engine (vLLM's and Sluice's extra), and this "
                                f"request {why}, which would drop it. Remove `{extras[0]}`.",
                           param=extras[0], code="unsupported_parameter")

    async def _refuse_if_late(self, gen: GenerationRequest) -> None:
        """`routing.refuse_past_target`: a 429 now, rather than a first token past the tier's target."""
        target = self.estimator.tier_target_s(gen.tier)
        if target is None:
            return
        est = await self.estimator.estimate_wait(gen.tier, len(gen.prompt_token_ids))
        if est > target:
            self.metrics.decisions.labels(gen.tier, "local", RouteReason.REFUSED_LATE).inc()
            known = math.isfinite(est)
            late = f"{est:.1f} s" if known else "unknown"
            raise APIError(429, f"The local engine cannot start this request within the {gen.tier} tier's "
                                f"{target:g} s target (estimated time to first token: {late}); retry shortly.",
                           code="engines_busy", retry_after=max(1, math.ceil(est - target)) if known else 1)

    def _embedded_can_take(self, gen: GenerationRequest) -> bool:
        return gen.target is Target.LOCAL and self.side.local_ready() and gen.model == self.side.local_model()

    async def _pooled_route(self, gen: GenerationRequest, t0: float) -> ChoiceStream:
        """The model has an engine pool (the module's docstring)."""
        assert self.pool is not None
        embedded = self._embedded_can_take(gen)
        if embedded and sum(w.free_slots for w in self.side.worker_stats()) > 0 \
                and await self.estimator.estimate_wait(gen.tier) == 0.0:
            return self._local(await self.local.submit(gen), gen, t0, RouteReason.LOCAL)
        # At most the tier's target (a time to first token) less what the next place takes to its first
        # token: then the embedded engine's queue, a provider, or an early 429.
        wait = self.estimator.tier_target_s(gen.tier) if self.routing.overflow else None
        if wait is not None and not embedded and self._has_providers(gen.model):
            assert self.remote is not None
            wait = max(0.0, wait - (self.remote.first_token_s(gen.model) or 0.0))
        try:
            stream = await self.pool.submit(gen, wait)
        except PoolBusy:
            if embedded:
                return self._local(await self.local.submit(gen), gen, t0, RouteReason.QUEUE_WAIT)
            if self._has_providers(gen.model) and not engine_only_fields(gen.api):
                return await self._remote(gen, RouteReason.QUEUE_WAIT, t0)
            raise APIError(429, f"Every engine replica serving `{gen.model}` is busy; retry shortly.",
                           code="engines_busy", retry_after=1) from None
        stream = PoolFallbackStream(gen, stream, self._after_pool)
        self.metrics.decisions.labels(gen.tier, "engine", RouteReason.POOL).inc()
        return self.accountant.wrap(stream, gen, t0)

    async def _after_pool(self, gen: GenerationRequest) -> ChoiceStream:
        """Where a request goes when every replica failed before its first token."""
        if self._embedded_can_take(gen):
            self.metrics.decisions.labels(gen.tier, "local", RouteReason.POOL_FAILED).inc()
            return await self.local.submit(gen)
        if self._has_providers(gen.model) and not engine_only_fields(gen.api):
            assert self.remote is not None
            self.metrics.decisions.labels(gen.tier, "remote", RouteReason.POOL_FAILED).inc()
            return await self.remote.submit(gen)
        raise PoolBusy(gen.model)

    def _local(self, stream: ChoiceStream, gen: GenerationRequest, t0: float, reason: RouteReason) -> ChoiceStream:
        assert gen.sampling is not None  # a local request carries the engine's parameters
        self.metrics.decisions.labels(gen.tier, "local", reason).inc()
        self.estimator.started_local(gen.request_id, gen.sampling.max_tokens * max(1, gen.n),
                                     len(gen.prompt_token_ids), gen.tier)
        return self.accountant.wrap(stream, gen, t0)

    async def _remote(self, gen: GenerationRequest, reason: RouteReason, t0: float,
                      est: float | None = None) -> ChoiceStream:
        if not self._has_providers(gen.model):
            raise APIError(503, "No engine worker is ready and no remote provider serves this model.",
                           code="not_ready", retry_after=1)
        assert self.remote is not None
        stream = await self.remote.submit(gen)
        if est is not None:
            log.info("route %s tier=%s -> remote (%s: estimated wait %s > target)", gen.request_id,
                     gen.tier, reason, f"{est * 1000:.0f} ms" if math.isfinite(est)
                     else "unknown (no free slot, no completion or step rate yet)")
        else:  # a remote-only model is not news; a fallback from local is
            log.log(logging.DEBUG if reason == RouteReason.REMOTE_ONLY else logging.INFO,
                    "route %s tier=%s -> remote (%s)", gen.request_id, gen.tier, reason)
        self.metrics.decisions.labels(gen.tier, "remote", reason).inc()
        return self.accountant.wrap(stream, gen, t0)
