"""Every answered request, local or remote, is accounted exactly as its response reports it: usage and
cost per key (the `/v1/usage` store and Prometheus), per-key token limits, and the latency histograms
(time to first token, inter-token time, end to end) by tier and backend; and a row in the usage ledger
(appended in memory, written off the request path) with the cost and its remote equivalent.

A key with a budget holds each request's worst-case cost while it runs (`reserve`, when the router takes
it): its prompt at the highest input price and n x max_tokens at the highest output price of the backends
it may be routed to (the local price, every provider serving the model). A remote provider counts the
prompt with its own tokenizer, so there the prompt is bounded by the request's size in bytes (no tokenizer
makes more tokens than bytes). Recording the answer settles the hold; a request that ends with nothing
to record releases it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Sequence
from typing import TypeVar

from prometheus_client import Histogram

from gateway.admission.ledger import UsageLedger, UsageRow
from gateway.admission.limits import Limiter
from gateway.admission.refusals import budget_spent, usage_unavailable
from gateway.admission.usage import ANON, SpendUnavailable, UsageStore
from gateway.backends.base import ChoiceStream, WrappedStream
from gateway.messages import LOCAL, ChoiceOutput, GenerationRequest
from gateway.observability.metrics import Metrics
from gateway.routing.estimate import WaitEstimator
from gateway.settings import ProviderSettings

log = logging.getLogger("sluice.router")
T = TypeVar("T")


def _requested_max_tokens(gen: GenerationRequest) -> int | None:
    """The client's own max_tokens (what a remote provider is sent), or None when it set none."""
    api = gen.api
    if api is None:
        return None
    requested = getattr(api, "requested_max_tokens", None)
    value = requested() if callable(requested) else getattr(api, "max_tokens", None)
    return int(value) if value is not None else None


class Accountant:
    def __init__(self, metrics: Metrics, usage: UsageStore, limiter: Limiter, estimator: WaitEstimator,
                 local_price: dict[str, float], *, providers: Sequence[ProviderSettings] = (),
                 ledger: UsageLedger | None = None, reserve_completion_tokens: int = 4096,
                 batch_price_factor: float = 1.0):
        self.metrics = metrics
        self.usage = usage
        self.limiter = limiter
        self.estimator = estimator
        self.local_price = local_price
        self.ledger = ledger
        self.reserve_completion_tokens = reserve_completion_tokens
        self.batch_price_factor = batch_price_factor
        # The first provider (by `order`, then config position) serving each model prices its equivalent.
        self._first_provider: dict[str, ProviderSettings] = {}
        for p in sorted(providers, key=lambda p: p.order):
            for model in p.models:
                self._first_provider.setdefault(model, p)

    # ------------------------------------------------------------ budget holds

    def worst_cost(self, gen: GenerationRequest, *, local: bool, providers: Sequence[ProviderSettings]) -> float:
        """The most this request can cost on any backend it may be routed to."""
        n = max(1, gen.n)
        worst = 0.0
        if local:
            assert gen.sampling is not None  # a local request carries the engine's parameters
            price = self.local_price
            worst = (len(gen.prompt_token_ids) * price.get("input_per_m", 0.0)
                     + n * gen.sampling.max_tokens * price.get("output_per_m", 0.0)) / 1e6
        if providers:
            prompt_bound = len(gen.api.model_dump_json(exclude_none=True)) if gen.api is not None \
                else len(gen.prompt_token_ids)
            requested = _requested_max_tokens(gen)
            if requested is not None:
                completion = requested
            elif gen.sampling is not None:  # tokenized here: at least the budget the local engine would get
                completion = max(gen.sampling.max_tokens, self.reserve_completion_tokens)
            else:  # a relay that sets no max_tokens: its provider's limit is unknown here
                completion = self.reserve_completion_tokens
            for p in providers:
                input_price = max(p.input_price_per_m, p.cached_input_price_per_m or 0.0)
                worst = max(worst, (prompt_bound * input_price + n * completion * p.output_price_per_m) / 1e6)
        return worst

    async def reserve(self, gen: GenerationRequest, *, local: bool, providers: Sequence[ProviderSettings]) -> None:
        """Hold the request's worst-case cost against its key's budget; raises the 429 (budget spent or
        held) or the 503 (spend cannot be checked). No budget: nothing to hold."""
        if self.limiter.limits_for(gen.key, gen.tier).budget is None:
            return
        await self.hold(gen.key, gen.tier, gen.request_id, self.worst_cost(gen, local=local, providers=providers))

    async def hold(self, key: str | None, tier: str, request_id: str, amount: float) -> None:
        """Hold `amount` against the key's budget for this request (nothing when it has no budget)."""
        budget = self.limiter.limits_for(key, tier).budget
        if budget is None:
            return
        try:
            hold = await self.usage.reserve(key, budget, request_id, amount)
        except SpendUnavailable:
            raise usage_unavailable() from None
        if not hold.ok:
            self.metrics.rate_limited.labels(key or ANON, "budget").inc()
            raise budget_spent(budget, hold.held)

    async def release(self, gen: GenerationRequest) -> None:
        """The request ended with nothing to record: drop its hold."""
        await self.usage.release(gen.request_id)

    def costs(self, model: str, provider: ProviderSettings | None, prompt: int, cached: int,
              completion: int) -> tuple[float, float]:
        """(cost, remote equivalent): a remote answer at its provider's prices (its own equivalent); a local
        one at the local price (else free), its equivalent at the prices of the first provider serving
        the model (the cost itself when no provider serves it)."""
        if provider is not None:
            cost = provider.cost(prompt, cached, completion)
            return cost, cost
        cost = self.local_cost(prompt, completion)
        first = self._first_provider.get(model)
        return cost, first.cost(prompt, cached, completion) if first is not None else cost

    def local_cost(self, prompt: int, completion: int) -> float:
        price = self.local_price
        return (prompt * price.get("input_per_m", 0.0) + completion * price.get("output_per_m", 0.0)) / 1e6

    # ------------------------------------------------------------ recording

    async def record(self, gen: GenerationRequest, stream: ChoiceStream, prompt: int, cached: int,
                     completion: int) -> None:
        if stream.backend == LOCAL:
            self.estimator.completed_local(completion)
        await self.record_usage(gen.key, gen.tier, gen.model, gen.request_id, stream.backend,
                                stream.provider_settings, prompt, cached, completion, batch=gen.batch)

    async def record_usage(self, key: str | None, tier: str, model: str, request_id: str, backend: str,
                           provider: ProviderSettings | None, prompt: int, cached: int, completion: int, *,
                           batch: bool = False) -> None:
        """One answered request (chat or embeddings): metrics, ledger row, totals, token limits; settles
        the request's budget hold. A Batch API line answered locally costs `batch_price_factor` of the
        local price, and its equivalent is the provider's batch price (OpenAI's: the same factor, half);
        one a provider answered online costs what that provider charges."""
        cost, equivalent = self.costs(model, provider, prompt, cached, completion)
        if batch and provider is None:
            cost, equivalent = cost * self.batch_price_factor, equivalent * self.batch_price_factor
        label = key or ANON  # the metrics' label
        m = self.metrics
        m.usage_requests.labels(label, model, backend).inc()
        m.usage_tokens.labels(label, model, backend, "prompt").inc(prompt)
        m.usage_tokens.labels(label, model, backend, "cached").inc(cached)
        m.usage_tokens.labels(label, model, backend, "completion").inc(completion)
        if cost:
            m.usage_cost.labels(label, model, backend).inc(cost)
        if self.ledger is not None:
            self.ledger.append(UsageRow(time.time(), key, tier, model, backend, prompt, cached, completion, cost,
                                        equivalent, batch))
        try:
            await self.usage.record(key, model, backend, prompt, cached, completion, cost, request_id=request_id)
            await self.limiter.charge_tokens(key, tier, prompt + completion)
            if batch:
                await self.limiter.charge_batch_tokens(key, tier, prompt + completion)
        except Exception:  # the answer went out; a store outage must not turn it into an error
            log.exception("usage accounting failed for %s", request_id)
        finally:
            await self.usage.release(request_id)  # settled by record; this only covers its failure

    def wrap(self, stream: ChoiceStream, gen: GenerationRequest, t0: float) -> AccountedStream:
        return AccountedStream(self, gen, stream, t0)


class AccountedStream(WrappedStream):
    """Passes outputs through; measures TTFT, inter-token time and end-to-end latency; on close
    records the request's usage and cost exactly as the response reports them."""

    def __init__(self, accountant: Accountant, gen: GenerationRequest, inner: ChoiceStream, t0: float):
        self._acc = accountant
        self._gen = gen
        self._inner = inner
        self._t0 = t0
        self._last: float | None = None
        self._itl: Histogram | None = None
        self._completion: dict[int, int] = {}
        self._cached = 0
        self._outputs = 0
        self._errored_early = False
        self._closed = False

    async def _pull(self, awaitable: Awaitable[T]) -> T:
        """The inner stream's next output(s); a failure before any output means nothing to account."""
        try:
            return await awaitable
        except StopAsyncIteration:
            raise
        except BaseException:
            if self._outputs == 0:
                self._errored_early = True
            raise

    async def __anext__(self) -> ChoiceOutput:
        ch = await self._pull(self._inner.__anext__())
        self._note(ch)
        return ch

    async def next_batch(self) -> list[ChoiceOutput]:
        batch = await self._pull(self._inner.next_batch())
        for ch in batch:
            self._note(ch)
        return batch

    def _note(self, ch: ChoiceOutput) -> None:
        self._outputs += 1
        out = ch.output
        if out.completion_tokens > self._completion.get(ch.index, 0):
            self._completion[ch.index] = out.completion_tokens
        if out.cached_tokens > self._cached:
            self._cached = out.cached_tokens
        if out.text:
            now = time.monotonic()
            if self._last is None:
                m = self._acc.metrics
                m.ttft.labels(self._gen.tier, self.backend).observe(now - self._t0)
                self._itl = m.itl.labels(self._gen.tier, self.backend)
            elif self._itl is not None:
                self._itl.observe(now - self._last)
            self._last = now

    def usage(self) -> tuple[int, int, int]:
        """(prompt, cached, completion) as the response reports them."""
        reported = self.prompt_tokens
        prompt = reported if reported is not None else len(self._gen.prompt_token_ids)
        return prompt, self._cached, sum(self._completion.values())

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._acc.estimator.ended_local(self._gen.request_id)
        task = asyncio.current_task()
        # A batch line cancelled (taken back for interactive requests, or the gateway stopping) is answered
        # again from the start later; charged then, not now.
        taken_back = self._gen.batch and task is not None and task.cancelling() > 0
        try:
            await self._inner.aclose()
        finally:
            if self._outputs and not self._errored_early and not taken_back:
                prompt, cached, completion = self.usage()
                self._acc.metrics.e2e.labels(self._gen.tier, self.backend).observe(time.monotonic() - self._t0)
                await asyncio.shield(self._acc.record(self._gen, self._inner, prompt, cached, completion))
            else:
                await asyncio.shield(self._acc.release(self._gen))
