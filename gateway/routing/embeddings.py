"""The embedding router: one embedding model's requests to its local engine or the remote providers that
serve the model, by the chat router's rules (routing/router.py) and with its reasons:

  * a request not tokenized here (a remote-only model, or no local worker ready) goes remote;
  * a model served both ways goes remote when the tier's queue is full (`queue_full`) or the estimated
    wait exceeds `tiers.<tier>.max_queue_wait_ms` (`queue_wait`): the tokens the engines still have to
    embed at the request's priority or better, over their measured tokens per second;
  * a local failure that is not the request's own fault (a failed step, a shutdown, a queue timeout) is
    retried remotely (`local_failed`) when `routing.local_retry_remote` is on;
  * a model with an engine pool (`[[engines]]`) routes as chat does there (router.py): the embedded
    engine while nothing waits at its priority or better, else a replica with room (`pool`, waiting in
    tier order at most the tier's target), else the embedded engine's queue, a provider, or an early 429;
    every replica failing moves it to the embedded engine or a provider (`pool_failed`).
Its budget hold is the request's prompt tokens at the highest input price it may be charged (the local
price, every provider serving the model; a provider counts with its own tokenizer, so there the bound
is the request's size in bytes); every answer is accounted as chat's are.
"""

from __future__ import annotations

import logging
import math
import time

from gateway.backends.local import EmbeddingFailed, LocalEmbeddings
from gateway.backends.pool.backend import LABEL as POOL_LABEL
from gateway.backends.pool.backend import PoolBackend, PoolBusy
from gateway.backends.remote.backend import RemoteBackend
from gateway.errors import APIError, Failure
from gateway.messages import EmbeddingJob, EmbeddingResult, ErrorOutput, Target
from gateway.observability.metrics import Metrics
from gateway.queue.base import QueueFull
from gateway.routing.accounting import Accountant
from gateway.routing.capacity import LocalSide
from gateway.routing.reasons import RouteReason
from gateway.settings import RoutingSettings, TierSettings

log = logging.getLogger("sluice.router")


def _retryable(failed: EmbeddingFailed) -> bool:
    """A failure another backend may fix: anything but the request's own fault (a 400)."""
    out = failed.output
    if isinstance(out, ErrorOutput):
        return out.failure is not Failure.INVALID_REQUEST
    return getattr(out, "error_code", None) is None


class EmbeddingRouter:
    def __init__(self, *, local: LocalEmbeddings, remote: RemoteBackend | None, side: LocalSide,
                 accountant: Accountant, routing: RoutingSettings, metrics: Metrics,
                 tiers: dict[str, TierSettings], pool: PoolBackend | None = None):
        self.local = local
        self.pool = pool
        self.remote = remote
        self.side = side
        self.accountant = accountant
        self.routing = routing
        self.metrics = metrics
        self.tiers = tiers

    def serves_remotely(self, model: str) -> bool:
        """Something besides the embedded engine serves the model: a provider or an engine pool."""
        return self._has_providers(model) or self._pooled(model)

    def _has_providers(self, model: str) -> bool:
        return self.remote is not None and bool(self.remote.chain(model))

    def _pooled(self, model: str) -> bool:
        return self.pool is not None and bool(self.pool.chain(model))

    async def embed(self, job: EmbeddingJob) -> EmbeddingResult:
        """Hold the worst-case cost, route, account the answer (the hold is settled or released)."""
        local = job.target is Target.LOCAL
        chain = self.remote.chain(job.model) if self.remote is not None else []
        await self.accountant.hold(job.key, job.tier, job.request_id, self._worst_cost(job, local, chain))
        t0 = time.monotonic()
        try:
            result = await self._route(job)
        except BaseException:
            await self.accountant.usage.release(job.request_id)
            raise
        self.metrics.e2e.labels(job.tier, result.backend).observe(time.monotonic() - t0)
        await self.accountant.record_usage(job.key, job.tier, job.model, job.request_id, result.backend,
                                           result.provider, result.prompt_tokens, 0, 0, batch=job.batch)
        return result

    def _worst_cost(self, job: EmbeddingJob, local: bool, chain: list) -> float:
        worst = self.accountant.local_cost(job.prompt_tokens, 0) if local else 0.0
        for p in chain:
            s = p.settings
            price = max(s.input_price_per_m, s.cached_input_price_per_m or 0.0)
            worst = max(worst, max(job.size_bytes, job.prompt_tokens) * price / 1e6)
        return worst

    async def _route(self, job: EmbeddingJob) -> EmbeddingResult:
        if self._pooled(job.model) and not job.batch:
            return await self._pooled_route(job)
        if job.target is Target.RELAY:
            reason = RouteReason.REMOTE_ONLY if job.model != self.side.local_model() else RouteReason.NO_WORKER
            return await self._remote(job, reason)
        if not self._has_providers(job.model):
            return await self._local(job, RouteReason.LOCAL_ONLY)
        if not self.side.local_ready():
            return await self._remote(job, RouteReason.NO_WORKER)
        target = self._target_s(job.tier)
        if self.routing.overflow and target is not None:
            est = self.estimate_wait(job)
            if est > target:
                log.info("route %s tier=%s -> remote (queue_wait: estimated %s > target)", job.request_id, job.tier,
                         f"{est:.1f} s" if math.isfinite(est) else "unknown")
                return await self._remote(job, RouteReason.QUEUE_WAIT)
        try:
            return await self._local(job, RouteReason.LOCAL)
        except QueueFull:
            return await self._remote(job, RouteReason.QUEUE_FULL)
        except EmbeddingFailed as e:
            if not (self.routing.local_retry_remote and _retryable(e)):
                raise
            log.warning("embedding %s failed locally (%s); retrying remotely", job.request_id, e)
            return await self._remote(job, RouteReason.LOCAL_FAILED)

    def _embedded_can_take(self, job: EmbeddingJob) -> bool:
        return job.target is Target.LOCAL and self.side.local_ready() and job.model == self.side.local_model()

    async def _pooled_route(self, job: EmbeddingJob) -> EmbeddingResult:
        """The model has an engine pool (the module's docstring)."""
        assert self.pool is not None
        embedded = self._embedded_can_take(job)
        if embedded and self._ahead(job) == 0:
            return await self._local(job, RouteReason.LOCAL)
        wait = self._target_s(job.tier) if self.routing.overflow else None
        try:
            answer = await self.pool.embed(job, wait)
        except PoolBusy:
            if embedded:
                return await self._local(job, RouteReason.QUEUE_WAIT)
            if self._has_providers(job.model):
                return await self._remote(job, RouteReason.QUEUE_WAIT)
            raise APIError(429, f"Every engine replica serving `{job.model}` is busy; retry shortly.",
                           code="engines_busy", retry_after=1) from None
        except APIError as e:
            if e.status < 500 and e.status != 429:
                raise  # the request's own fault: another place would refuse it too
            log.warning("embedding %s failed on every replica (%s)", job.request_id, e.message)
            if embedded:
                return await self._local(job, RouteReason.POOL_FAILED)
            if self._has_providers(job.model):
                return await self._remote(job, RouteReason.POOL_FAILED)
            raise
        self.metrics.decisions.labels(job.tier, POOL_LABEL, RouteReason.POOL).inc()
        return EmbeddingResult(backend=f"{POOL_LABEL}:{answer.provider.name}", prompt_tokens=answer.prompt_tokens or 0,
                               body=answer.body)  # no provider: the team's own capacity, at the local price

    def _ahead(self, job: EmbeddingJob) -> int:
        """Tokens the embedded engine has yet to embed at the request's priority or better."""
        return sum(n for w in self.side.worker_stats() for prio, n in (w.pending_tokens or {}).items()
                   if int(prio) <= job.priority)

    def _target_s(self, tier: str) -> float | None:
        t = self.tiers.get(tier)
        return None if t is None or t.max_queue_wait_ms is None else t.max_queue_wait_ms / 1000

    def estimate_wait(self, job: EmbeddingJob) -> float:
        """Seconds until this request's vectors are out: the tokens the engines have yet to embed at its
        priority or better, plus its own, over their tokens per busy second (0 with nothing known)."""
        ahead = self._ahead(job)
        tokens = 0
        busy = 0.0
        for w in self.side.worker_stats():
            tokens += w.tokens or 0
            busy += w.busy_seconds or 0.0
        if tokens <= 0 or busy <= 0:
            return 0.0  # no throughput measured yet: local (the first requests measure it)
        return (ahead + job.prompt_tokens) / (tokens / busy)

    async def _local(self, job: EmbeddingJob, reason: RouteReason) -> EmbeddingResult:
        result = await self.local.embed(job)
        self.metrics.decisions.labels(job.tier, "local", reason).inc()
        return result

    async def _remote(self, job: EmbeddingJob, reason: RouteReason) -> EmbeddingResult:
        if self.remote is None or not self._has_providers(job.model):
            raise APIError(503, "No embedding worker is ready and no remote provider serves this model.",
                           code="not_ready", retry_after=1)
        answer = await self.remote.embeddings(job.request_id, job.model, job.body, job.deadline)
        log.log(logging.DEBUG if reason == RouteReason.REMOTE_ONLY else logging.INFO,
                "route %s tier=%s -> remote (%s)", job.request_id, job.tier, reason)
        self.metrics.decisions.labels(job.tier, "remote", reason).inc()
        usage = answer.body.get("usage") if isinstance(answer.body, dict) else None
        prompt = int(usage.get("prompt_tokens") or 0) if isinstance(usage, dict) else 0
        return EmbeddingResult(backend=answer.backend, prompt_tokens=prompt, body=answer.body,
                               provider=answer.provider)
