"""The router: picks the backend of each request (local engine or a remote provider chain), and
accounts for every request (usage, cost, latency metrics, per-key token limits).

Routing, local first:
  * a model only providers serve goes remote (`remote_only`); so does any request when no engine
    worker is ready (`no_worker`);
  * a model served both ways goes remote when the estimated queue wait for the request's tier exceeds
    `tiers.<tier>.max_queue_wait_ms` (`queue_wait`) or the tier's queue is full (`queue_full`);
  * a local failure before the first token is retried remotely (`local_failed`).
The estimate: a request waits for the completions that free a slot for it, so
    wait = need / completion_rate,   need = ahead + 1 - free_slots   (0 when need <= 0)
where `ahead` is what is queued in tiers of the same or a higher priority, `free_slots` the engine's
unused capacity and `completion_rate` the local completions per second over the last
`routing.completion_window_s`. When completions are scarce (fewer than `MIN_COMPLETIONS` in the
window: a cold start, or long requests holding every slot) the rate comes from the engine instead:
    wait = need * tokens_per_request * step_seconds / capacity
with `step_seconds` measured from the worker's step counter (and busy time), `tokens_per_request` the
average completion of past local requests (else the `max_tokens` of those running now). With neither
known and no free slot the wait is unknown (infinite: overflow). `pro` has nothing of `standard`
ahead of it and a larger target, so it stays local longest. Each decision is counted
(`sluice_route_decisions_total`) and logged (remote ones at INFO), and every response carries
`x-sluice-backend: local|remote:<provider>`.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import math
import time
from collections import deque
from typing import Any

from aiohttp import web

from gateway.auth import KEY_NAME, TIER_KEY
from gateway.backends.base import Backend, ChoiceOutput, ChoiceStream, GenerationRequest
from gateway.backends.remote import RemoteBackend, RemoteStream
from gateway.errors import APIError
from gateway.limits import Limiter, make_limiter
from gateway.metrics import Metrics
from gateway.queue.base import ErrorOutput, QueueFull
from gateway.remote_config import LimitSettings, RoutingSettings
from gateway.usage import ANON, UsageStore

log = logging.getLogger("sluice.router")

BACKEND_HEADER = "x-sluice-backend"
MIN_COMPLETIONS = 3  # fewer local completions in the window: estimate from the engine's step rate
LIMITED_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})


def _settings_section(settings: Any, name: str, cls: type) -> Any:
    v = getattr(settings, name, None)
    if v is None:
        return cls()
    if isinstance(v, cls):
        return v
    return cls.model_validate(v if isinstance(v, dict) else v.model_dump())


class Router(Backend):
    name = "router"

    def __init__(self, state: Any, local: Backend | None, *, remote: RemoteBackend | None = None,
                 metrics: Metrics | None = None, usage: UsageStore | None = None,
                 limiter: Limiter | None = None):
        self.state = state
        self.local = local
        settings = state.settings
        self.routing: RoutingSettings = _settings_section(settings, "routing", RoutingSettings)
        self.metrics = metrics or Metrics(state.registry)
        providers = list(getattr(settings, "providers", None) or [])
        self.remote = remote if remote is not None else (
            RemoteBackend(providers, self.routing, self.metrics) if providers else None)
        limit_settings = _settings_section(settings, "limits", LimitSettings)
        queue_redis = getattr(settings, "redis_url", None)
        self.limiter = limiter or make_limiter(limit_settings, queue_redis)
        self.usage = usage or UsageStore(limit_settings.redis_url or queue_redis)
        self._completions: deque[float] = deque()
        self._tokens_per_request: float | None = None  # EWMA of local completions' completion tokens
        self._local_max_tokens: dict[str, int] = {}  # local requests in flight: their max_tokens
        self._step_sample: tuple[float, float, float | None] | None = None  # (time, steps, busy s)
        self._step_s: float | None = None  # seconds per engine step (decaying average)
        self._step_sums = (0.0, 0.0)  # decaying (seconds, steps) behind it
        self._started = time.monotonic()
        self._workers_cache: tuple[float, list[dict[str, Any]] | None] = (0.0, None)
        self._busy_last: tuple[float, float] | None = None
        self._sampler: asyncio.Task | None = None
        self._tapped = False

    # ------------------------------------------------------------ what is served where

    def serves_remotely(self, model: str) -> bool:
        return self.remote is not None and bool(self.remote.chain(model))

    def remote_models(self) -> list[str]:
        return self.remote.models() if self.remote is not None else []

    async def _workers(self) -> list[dict[str, Any]] | None:
        """Live remote engine workers (Redis topology), from the gateway's worker watcher."""
        return getattr(self.state, "workers", None)

    async def local_available(self) -> bool:
        """Is an engine worker ready? `state.ready`: the embedded worker runs, or (gateway without an
        engine) live workers' heartbeats exist; False while loading or draining."""
        return bool(self.state.ready)

    async def _free_slots(self) -> int:
        st = self.state
        if st.worker is not None:
            s = st.worker.stats()
            return max(0, int(s.get("capacity", 0)) - int(s.get("in_flight", 0)))
        ws = await self._workers() or []
        return sum(max(0, int(w.get("capacity", 0)) - int(w.get("in_flight", 0)))
                   for w in ws if not w.get("draining"))

    # ------------------------------------------------------------ the overflow estimate

    def completion_rate(self) -> float:
        now = time.monotonic()
        w = self.routing.completion_window_s
        while self._completions and now - self._completions[0] > w:
            self._completions.popleft()
        span = min(w, now - self._started)
        return len(self._completions) / span if span > 0 else 0.0

    def tier_target_s(self, tier: str) -> float | None:
        t = self.state.settings.tiers.get(tier)
        ms = getattr(t, "max_queue_wait_ms", None) if t is not None else None
        return None if ms is None else ms / 1000

    async def _engine_counters(self) -> tuple[float, float | None, int] | None:
        """(steps, busy seconds or None, capacity) summed over the engine workers, or None."""
        st = self.state
        if st.worker is not None:
            s = st.worker.stats()
            if "steps" not in s:
                return None
            busy = s.get("busy_seconds")
            return float(s["steps"]), None if busy is None else float(busy), int(s.get("capacity", 0))
        ws = [w for w in (await self._workers() or []) if "steps" in w]  # heartbeats that carry it
        if not ws:
            return None
        busy = [float(w["busy_seconds"]) for w in ws if "busy_seconds" in w]
        return (sum(float(w["steps"]) for w in ws), sum(busy) if len(busy) == len(ws) else None,
                sum(int(w.get("capacity", 0)) for w in ws))

    async def _sample_steps(self) -> None:
        """Update the seconds-per-step estimate from the step counter (and busy time when known)."""
        c = await self._engine_counters()
        if c is None:
            return
        steps, busy, _ = c
        now = time.monotonic()
        last = self._step_sample
        if last is not None and now - last[0] < 0.2:
            return
        self._step_sample = (now, steps, busy)
        if last is None or steps <= last[1]:
            return  # idle (or a restarted worker): keep the last estimate
        d_steps = steps - last[1]
        if busy is not None and last[2] is not None and busy > last[2]:
            d_time = busy - last[2]
        else:  # wall time: an upper bound when the engine idled part of the interval
            d_time = now - last[0]
        # Decaying sums weighted by steps: an interval with a few steps after an idle spell (whose wall
        # time overstates the step time) moves the estimate little; a busy interval moves it most.
        t_sum, s_sum = self._step_sums
        self._step_sums = (0.5 * t_sum + d_time, 0.5 * s_sum + d_steps)
        self._step_s = self._step_sums[0] / self._step_sums[1]

    def step_seconds(self) -> float | None:
        """The measured seconds per engine step (None until the engine has stepped while sampled)."""
        return self._step_s

    async def estimate_wait(self, tier: str) -> float:
        tiers = self.state.settings.tiers
        q = self.state.queue
        if q is None:
            return 0.0
        prio = tiers[tier].priority if tier in tiers else max(t.priority for t in tiers.values())
        ahead = 0
        for name, t in tiers.items():
            if t.priority <= prio:
                ahead += await q.depth(name)
        need = ahead + 1 - await self._free_slots()
        if need <= 0:
            return 0.0
        await self._sample_steps()
        rate = self.completion_rate()
        if len(self._completions) >= MIN_COMPLETIONS and rate > 0:
            return need / rate
        est = await self._wait_from_steps(need)  # completions are scarce: the engine's step rate
        if est is not None:
            return est
        return need / rate if rate > 0 else math.inf  # nothing known and no free slot

    async def _wait_from_steps(self, need: int) -> float | None:
        step_s = self._step_s
        tokens = self._tokens_per_request
        if tokens is None and self._local_max_tokens:
            tokens = sum(self._local_max_tokens.values()) / len(self._local_max_tokens)
        c = await self._engine_counters()
        if step_s is None or tokens is None or c is None:
            return None
        capacity = max(1, c[2])
        return need * max(1.0, tokens) * step_s / capacity

    # ------------------------------------------------------------ submit

    async def submit(self, gen: GenerationRequest) -> ChoiceStream:
        t0 = time.monotonic()
        model = gen.model
        remote_ok = self.serves_remotely(model)
        if not gen.prompt_token_ids:  # the handler did not tokenize: the local side cannot take it
            reason = "remote_only" if model != self.state.model_name else "no_worker"
            return await self._remote(gen, reason, t0)
        if not remote_ok or self.local is None:
            return self._account(await self._local_submit(gen), gen, t0, "local", "local_only")
        if not await self.local_available():
            return await self._remote(gen, "no_worker", t0)
        target = self.tier_target_s(gen.tier)
        if self.routing.overflow and target is not None:
            est = await self.estimate_wait(gen.tier)
            if est > target:
                return await self._remote(gen, "queue_wait", t0, est)
        try:
            stream = await self._local_submit(gen)
        except QueueFull:
            return await self._remote(gen, "queue_full", t0)
        if self.routing.local_retry_remote:
            stream = _FallbackStream(self, gen, stream)
        return self._account(stream, gen, t0, "local", "local")

    async def _local_submit(self, gen: GenerationRequest) -> ChoiceStream:
        assert self.local is not None
        return await self.local.submit(gen)

    async def _remote(self, gen: GenerationRequest, reason: str, t0: float,
                      est: float | None = None) -> ChoiceStream:
        if self.remote is None or not self.remote.chain(gen.model):
            raise APIError(503, "No engine worker is ready and no remote provider serves this model.",
                           code="not_ready", retry_after=1)
        stream = await self.remote.submit(gen)
        if est is not None:
            log.info("route %s tier=%s -> remote (%s: estimated wait %s > target)", gen.request_id,
                     gen.tier, reason, f"{est * 1000:.0f} ms" if math.isfinite(est)
                     else "unknown (no free slot, no completion or step rate yet)")
        else:  # a remote-only model is not news; a fallback from local is
            log.log(logging.DEBUG if reason == "remote_only" else logging.INFO, "route %s tier=%s -> remote (%s)",
                    gen.request_id, gen.tier, reason)
        return self._account(stream, gen, t0, "remote", reason)

    def _account(self, stream: ChoiceStream, gen: GenerationRequest, t0: float, kind: str,
                 reason: str) -> ChoiceStream:
        self.metrics.decisions.labels(gen.tier, kind, reason).inc()
        if kind == "local":
            self._local_max_tokens[gen.request_id] = int(gen.sampling.max_tokens or 0) * max(1, gen.n)
        return _AccountedStream(self, gen, stream, t0)

    # ------------------------------------------------------------ accounting

    def cost(self, backend: str, stream: Any, prompt: int, cached: int, completion: int) -> float:
        provider = getattr(stream, "provider", None)
        if backend.startswith("remote:") and provider is not None:
            return provider.settings.cost(prompt, cached, completion)
        price = self.routing.local_price
        return (prompt * price.get("input_per_m", 0.0) + completion * price.get("output_per_m", 0.0)) / 1e6

    async def record(self, gen: GenerationRequest, backend: str, stream: Any, prompt: int, cached: int,
                     completion: int) -> None:
        if backend == "local":
            self._completions.append(time.monotonic())
            t = self._tokens_per_request
            self._tokens_per_request = completion if t is None else 0.8 * t + 0.2 * completion
        cost = self.cost(backend, stream, prompt, cached, completion)
        key = gen.key or ANON
        m = self.metrics
        m.usage_requests.labels(key, gen.model, backend).inc()
        m.usage_tokens.labels(key, gen.model, backend, "prompt").inc(prompt)
        m.usage_tokens.labels(key, gen.model, backend, "cached").inc(cached)
        m.usage_tokens.labels(key, gen.model, backend, "completion").inc(completion)
        if cost:
            m.usage_cost.labels(key, gen.model, backend).inc(cost)
        try:
            await self.usage.record(gen.key, gen.model, backend, prompt, cached, completion, cost)
            await self.limiter.charge_tokens(gen.key, gen.tier, prompt + completion)
        except Exception:
            log.exception("usage accounting failed for %s", gen.request_id)

    # ------------------------------------------------------------ lifecycle and sampling

    def tap_queue(self) -> None:
        """Observe queue time of local requests where this process pulls (the embedded worker)."""
        q = self.state.queue
        if q is None or self._tapped:
            return
        self._tapped = True
        pull = q.pull
        hist = self.metrics.queue_time

        async def tapped_pull(*a: Any, **kw: Any) -> Any:
            items = await pull(*a, **kw)
            now = time.time()
            for it in items:
                hist.labels(it.tier).observe(max(0.0, now - it.enqueued_at))
            return items

        q.pull = tapped_pull  # instance attribute: the worker looks it up on each call

    async def _sample_once(self) -> None:
        st = self.state
        m = self.metrics
        try:
            await self._sample_steps()
        except Exception:
            log.debug("step sampling failed", exc_info=True)
        if st.queue is not None:
            for tier in st.settings.tiers:
                try:
                    m.queue_depth.labels(tier).set(await st.queue.depth(tier))
                    est = await self.estimate_wait(tier)
                    m.queue_wait_estimate.labels(tier).set(est if math.isfinite(est) else -1)
                except Exception:
                    pass
        busy = None
        stats = getattr(st.engine, "stats", None)
        if stats is not None and hasattr(stats, "busy_seconds"):
            busy = float(stats.busy_seconds)
        else:  # Redis topology: the workers' heartbeats may carry it
            ws = await self._workers() or []
            vals = [float(w["busy_seconds"]) for w in ws if "busy_seconds" in w]
            busy = sum(vals) if vals else None
        if busy is not None:
            now = time.monotonic()
            m.busy_seconds.set(busy)
            if self._busy_last is not None and now > self._busy_last[0]:
                ratio = (busy - self._busy_last[1]) / (now - self._busy_last[0])
                m.busy_ratio.set(min(1.0, max(0.0, ratio)))
            self._busy_last = (now, busy)
        if self.remote is not None:
            for p in self.remote.providers:
                m.breaker.labels(p.name).set(0 if p.breaker.state == "closed" else 1)

    async def _sampler_loop(self) -> None:
        frozen = False
        while True:
            try:
                if self.state.worker is not None:
                    self.tap_queue()
                if not frozen and self.state.model_name is not None:
                    # Once the engine (torch, weights, tokenizer) is loaded, move its millions of
                    # long-lived objects out of the cyclic GC's reach: otherwise each older-generation
                    # collection walks them all, which measured 2-4x the CPU per relayed request.
                    frozen = True
                    gc.collect()
                    gc.freeze()
                await self._sample_once()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.debug("metrics sampling failed", exc_info=True)
            await asyncio.sleep(1.0)

    def start(self) -> None:
        self._sampler = asyncio.create_task(self._sampler_loop(), name="sluice-router-sampler")

    async def close(self) -> None:
        if self._sampler is not None:
            self._sampler.cancel()
            await asyncio.gather(self._sampler, return_exceptions=True)
        if self.remote is not None:
            await self.remote.close()
        await self.limiter.close()
        await self.usage.close()


class _WrappedStream(ChoiceStream):
    """A stream around another one: it reports where the inner stream was served."""

    _inner: ChoiceStream

    @property
    def backend(self) -> str:  # type: ignore[override]
        return getattr(self._inner, "backend", "local")

    @property
    def prompt_tokens(self) -> int | None:  # type: ignore[override]
        return getattr(self._inner, "prompt_tokens", None)

    @property
    def provider(self) -> Any:
        return getattr(self._inner, "provider", None)


class _FallbackStream(_WrappedStream):
    """The local stream, replaced by a remote one when the first local output is a failure."""

    def __init__(self, router: Router, gen: GenerationRequest, local: ChoiceStream):
        self._router = router
        self._gen = gen
        self._inner = local
        self._first = True


    @staticmethod
    def _failed(out: Any) -> bool:
        if isinstance(out, ErrorOutput):
            return out.error_status >= 500
        return out.finish_reason in ("error", "abort") and not out.text

    async def __anext__(self) -> ChoiceOutput:
        ch = await self._inner.__anext__()
        if self._first:
            self._first = False
            r = self._router
            if self._failed(ch.output) and r.serves_remotely(self._gen.model):
                log.warning("local failure before the first token for %s (%s); retrying remotely",
                            self._gen.request_id, ch.output.error or ch.output.finish_reason)
                await self._inner.aclose()
                r.metrics.decisions.labels(self._gen.tier, "remote", "local_failed").inc()
                self._inner = await r.remote.submit(self._gen)  # type: ignore[union-attr]
                return await self._inner.__anext__()
        return ch

    async def aclose(self) -> None:
        await self._inner.aclose()


class _AccountedStream(_WrappedStream):
    """Passes outputs through; measures TTFT, inter-token time and end-to-end latency; on close
    records the request's usage and cost exactly as the response reports them."""

    def __init__(self, router: Router, gen: GenerationRequest, inner: ChoiceStream, t0: float):
        self._router = router
        self._gen = gen
        self._inner = inner
        self._t0 = t0
        self._last: float | None = None
        self._itl: Any = None
        self._completion: dict[int, int] = {}
        self._cached = 0
        self._prompt_seen = 0
        self._outputs = 0
        self._errored_early = False
        self._closed = False


    async def __anext__(self) -> ChoiceOutput:
        try:
            ch = await self._inner.__anext__()
        except StopAsyncIteration:
            raise
        except BaseException:
            if self._outputs == 0:
                self._errored_early = True
            raise
        self._outputs += 1
        out = ch.output
        if out.completion_tokens > self._completion.get(ch.index, 0):
            self._completion[ch.index] = out.completion_tokens
        if out.cached_tokens > self._cached:
            self._cached = out.cached_tokens
        if out.text:
            now = time.monotonic()
            if self._last is None:
                backend = self.backend
                self._router.metrics.ttft.labels(self._gen.tier, backend).observe(now - self._t0)
                self._itl = self._router.metrics.itl.labels(self._gen.tier, backend)
            else:
                self._itl.observe(now - self._last)
            self._last = now
        return ch

    def usage(self) -> tuple[int, int, int]:
        """(prompt, cached, completion) as the response reports them."""
        reported = self.prompt_tokens
        prompt = reported if reported is not None else len(self._gen.prompt_token_ids)
        return prompt, self._cached, sum(self._completion.values())

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._router._local_max_tokens.pop(self._gen.request_id, None)
        try:
            await self._inner.aclose()
        finally:
            if self._outputs and not self._errored_early:
                backend = self.backend
                prompt, cached, completion = self.usage()
                self._router.metrics.e2e.labels(self._gen.tier, backend).observe(time.monotonic() - self._t0)
                await asyncio.shield(self._router.record(self._gen, backend, self._inner, prompt, cached,
                                                         completion))


def stream_prompt_tokens(stream: ChoiceStream, fallback: int) -> int:
    """The prompt tokens a response reports: the provider's count when remote, else the local count."""
    v = getattr(stream, "prompt_tokens", None)
    return fallback if v is None else int(v)


def stream_backend(stream: ChoiceStream) -> str:
    return getattr(stream, "backend", "local")


# ---------------------------------------------------------------- HTTP pieces


def _router(request: web.Request) -> Router | None:
    from gateway.app import STATE

    return getattr(request.app[STATE], "router", None)


@web.middleware
async def limits_middleware(request: web.Request, handler):
    """Per-key requests/tokens per minute and budget, before any work on the request."""
    if request.method == "POST" and request.path in LIMITED_PATHS:
        router = _router(request)
        if router is not None:
            key = request.get(KEY_NAME)
            tier = request.get(TIER_KEY, "standard")
            lim = router.limiter.limits_for(key, tier)
            spent = await router.usage.spent(key) if lim.budget is not None else 0.0
            v = await router.limiter.admit(key, tier, spent)
            if not v.ok:
                router.metrics.rate_limited.labels(key or ANON, v.reason).inc()
                if v.reason == "budget":
                    raise APIError(429, f"This key's budget ({v.limit}) is spent.", type="insufficient_quota",
                                   code="insufficient_quota")
                what = "requests" if v.reason == "rpm" else "tokens"
                raise APIError(429, f"Rate limit reached: {v.limit} {what} per minute for this key. "
                                    f"Retry in {math.ceil(v.retry_after or 1)} s.",
                               type="rate_limit_error", code="rate_limit_exceeded", retry_after=v.retry_after)
    return await handler(request)


async def usage_handler(request: web.Request) -> web.Response:
    """GET /v1/usage: the calling key's totals (all time), by model and by backend."""
    router = _router(request)
    key = request.get(KEY_NAME)
    body = await router.usage.totals(key) if router is not None else {"totals": {}}
    body = {"object": "usage", "key": key or ANON, **body}
    return web.json_response(body)


def install(app: web.Application) -> None:
    """Wire the router into an app built by `gateway.app.create_app`: wrap the local backend once the
    app's lifecycle created it, add the limits middleware (after auth) and `GET /v1/usage`."""
    from gateway.app import STATE

    app.middlewares.append(limits_middleware)
    app.router.add_get("/v1/usage", usage_handler)

    async def ctx(app: web.Application):
        state = app[STATE]
        router = Router(state, state.backend)
        state.router = router
        state.backend = router
        router.start()
        yield
        await router.close()

    app.cleanup_ctx.append(ctx)
