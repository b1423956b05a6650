"""The routing parts on their own, with a fake view of the local side: the wait estimate, the routing
decision, accounting and the fallback. No app, no HTTP, no engine."""

from __future__ import annotations

import asyncio
import math
import time

import pytest

from engine import EngineRequest, RequestOutput, SamplingParams
from gateway.admission.limits import MemoryLimiter
from gateway.admission.usage import UsageStore
from gateway.backends.base import Backend, ChoiceStream
from gateway.backends.local import LocalBackend
from gateway.backends.remote.backend import RemoteBackend
from gateway.errors import APIError, Failure
from gateway.messages import ChoiceOutput, GenerationRequest, QueueItem, Target, WorkerStats, error_output
from gateway.observability.metrics import Metrics
from gateway.openai.schema import ChatCompletionRequest
from gateway.queue.base import QueueFull
from gateway.queue.memory import MemoryQueue
from gateway.routing.accounting import Accountant
from gateway.routing.estimate import WaitEstimator
from gateway.routing.fallback import FallbackStream
from gateway.routing.router import Router
from gateway.settings import LimitSettings, ProviderSettings, RoutingSettings, TierSettings
from tests.fixtures.clock import Clock

TIERS = {"pro": TierSettings(priority=0, max_queue_wait_ms=10_000),
         "standard": TierSettings(priority=1, max_queue_wait_ms=2_000)}


class Side:
    """A fake local side: its readiness, model and workers are whatever the test sets."""

    def __init__(self, workers: list[WorkerStats] | None = None, ready: bool = True, model: str = "local-m"):
        self.workers = workers if workers is not None else [WorkerStats(capacity=2, in_flight=2)]
        self.ready = ready
        self.model = model

    def local_ready(self) -> bool:
        return self.ready

    def local_model(self) -> str | None:
        return self.model

    def worker_stats(self) -> list[WorkerStats]:
        return self.workers


async def _queue(pro: int = 0, standard: int = 0) -> MemoryQueue:
    q = MemoryQueue(max_depth=100)
    for i in range(pro):
        await q.put(QueueItem(EngineRequest(f"p{i}", [1], priority=0), tier="pro"))
    for i in range(standard):
        await q.put(QueueItem(EngineRequest(f"s{i}", [1], priority=1), tier="standard"))
    return q


# ---------------------------------------------------------------- the estimate


async def test_a_free_slot_means_no_wait():
    side = Side([WorkerStats(capacity=4, in_flight=1)])
    est = WaitEstimator(side, await _queue(standard=2), TIERS, RoutingSettings())
    assert await est.estimate_wait("standard") == 0.0  # 2 ahead + itself = 3 <= 3 free slots


async def test_wait_from_the_completion_rate_counts_only_tiers_ahead():
    clock = Clock()
    est = WaitEstimator(Side(), await _queue(pro=3, standard=5), TIERS, RoutingSettings(completion_window_s=10),
                        clock=clock)
    clock.t += 10
    for _ in range(20):  # 2 completions/s over the window
        est.completed_local(32)
    # standard waits behind 3 pro + 5 standard (+1 itself, 0 free): 9 / 2 per s; pro only behind pro: 4 / 2
    assert await est.estimate_wait("standard") == pytest.approx(4.5)
    assert await est.estimate_wait("pro") == pytest.approx(2.0)


async def test_higher_tiers_arrivals_leave_a_lower_tier_less_of_the_completion_rate():
    clock = Clock()
    est = WaitEstimator(Side(), await _queue(pro=1, standard=1), TIERS, RoutingSettings(completion_window_s=10),
                        clock=clock)
    clock.t += 10
    for _ in range(20):  # 2 completions/s
        est.completed_local(32)
    for i in range(15):  # 1.5 pro/s started locally: standard is left 0.5/s
        est.started_local(f"p{i}", 32, tier="pro")
    # standard: 1 pro + 1 standard + itself = 3, at 2 - 1.5 per s; pro counts no one above it
    assert await est.estimate_wait("standard") == pytest.approx(3 / 0.5)
    assert await est.estimate_wait("pro") == pytest.approx(2 / 2.0)
    for i in range(5):  # 2 pro/s: nothing left for standard, which should not wait for it locally
        est.started_local(f"q{i}", 32, tier="pro")
    assert math.isinf(await est.estimate_wait("standard"))
    clock.t += 11  # the window forgets them (and the completions: the step rate is unknown)
    assert math.isinf(await est.estimate_wait("standard"))
    assert est.higher_rate(1) == 0.0


async def test_scarce_completions_fall_back_on_the_step_rate():
    clock = Clock()
    worker = WorkerStats(capacity=2, in_flight=2, steps=0, busy_seconds=0.0)
    est = WaitEstimator(Side([worker]), await _queue(standard=1), TIERS, RoutingSettings(), clock=clock)
    est.started_local("a", 100)
    est.started_local("b", 100)
    est.sample_steps()
    clock.t += 1.0
    worker.steps, worker.busy_seconds = 50, 1.0  # 20 ms a step
    wait = await est.estimate_wait("standard")
    # need = 1 ahead + 1 - 0 free = 2; 100 tokens a request; 0.02 s a step; 2 slots
    assert est.step_seconds() == pytest.approx(0.02)
    assert wait == pytest.approx(2 * 100 * 0.02 / 2)


async def test_nothing_known_and_no_free_slot_is_an_infinite_wait():
    est = WaitEstimator(Side(), await _queue(), TIERS, RoutingSettings())
    assert math.isinf(await est.estimate_wait("standard"))


def _busy_engine(clock: Clock, est: WaitEstimator, worker: WorkerStats, tokens_per_s: float, pending: int) -> None:
    """Two samples one second apart: the engine computed `tokens_per_s` prompt tokens with `pending` left."""
    worker.prefill_tokens, worker.prefill_pending = 0, pending
    est.sample_prefill()
    clock.t += 1.0
    worker.prefill_tokens = int(tokens_per_s)
    est.sample_prefill()


async def test_a_free_slot_in_a_busy_engine_still_waits_for_the_prefill_ahead():
    clock = Clock()
    worker = WorkerStats(capacity=64, in_flight=10)  # 54 free slots: the slot wait alone says 0
    est = WaitEstimator(Side([worker]), await _queue(), TIERS, RoutingSettings(), clock=clock)
    assert await est.estimate_wait("standard", 500) == 0.0  # no prefill rate measured yet
    _busy_engine(clock, est, worker, 1000, 3000)
    assert est.prefill_rate() == pytest.approx(1000)
    # 3000 pending + its own 500, at 1000 tokens/s
    assert await est.estimate_wait("standard", 500) == pytest.approx(3.5)
    worker.prefill_pending = 0
    assert await est.estimate_wait("standard") == 0.0  # nothing pending and no prompt: no wait


async def test_prompts_queued_ahead_count_at_the_average_prompt_length():
    clock = Clock()
    worker = WorkerStats(capacity=4, in_flight=0)  # free slots for both queued and this one
    est = WaitEstimator(Side([worker]), await _queue(pro=1, standard=1), TIERS, RoutingSettings(), clock=clock)
    est.started_local("x", 16, prompt_tokens=400)
    _busy_engine(clock, est, worker, 800, 100)
    # 2 queued ahead (of a standard request) x 400 + 100 pending + its own 200, at 800 tokens/s
    assert await est.estimate_wait("standard", 200) == pytest.approx((2 * 400 + 100 + 200) / 800)


async def test_an_interval_that_began_with_nothing_pending_says_nothing_of_the_prefill_rate():
    clock = Clock()
    worker = WorkerStats(capacity=4)
    est = WaitEstimator(Side([worker]), await _queue(), TIERS, RoutingSettings(), clock=clock)
    _busy_engine(clock, est, worker, 50, 0)  # 50 tokens in a second, but it was idle at the start
    assert est.prefill_rate() is None


# ---------------------------------------------------------------- the decision


class Stream(ChoiceStream):
    def __init__(self, outputs: list[RequestOutput], backend: str = "local", settings: ProviderSettings | None = None):
        self.outputs = list(outputs)
        self.closed = False
        self._backend = backend
        self._settings = settings

    @property
    def backend(self) -> str:
        return self._backend

    @property
    def provider_settings(self) -> ProviderSettings | None:
        return self._settings

    async def __anext__(self) -> ChoiceOutput:
        if not self.outputs:
            raise StopAsyncIteration
        return ChoiceOutput(0, self.outputs.pop(0))

    async def aclose(self) -> None:
        self.closed = True


class Local(Backend):
    def __init__(self, outputs: list[RequestOutput] | None = None, full: bool = False):
        self.submitted: list[str] = []
        self.outputs = outputs or [RequestOutput("r", text="hi", finished=True, finish_reason="stop",
                                                 prompt_tokens=3, completion_tokens=1)]
        self.full = full

    async def submit(self, request: GenerationRequest) -> ChoiceStream:
        if self.full:
            raise QueueFull(request.tier, 9)
        self.submitted.append(request.request_id)
        return Stream(self.outputs)


class Remote(RemoteBackend):
    """A provider chain that never calls out: its streams are canned."""

    def __init__(self, metrics: Metrics):
        super().__init__([ProviderSettings(name="p", base_url="http://127.0.0.1:9/v1", models={"local-m": "x"},
                                           input_price_per_m=1.0, output_price_per_m=2.0)], RoutingSettings(), metrics)
        self.submitted: list[str] = []

    async def submit(self, gen: GenerationRequest) -> ChoiceStream:
        self.submitted.append(gen.request_id)
        return Stream([RequestOutput(gen.request_id, text="remote", finished=True, finish_reason="stop",
                                     completion_tokens=2)], backend="remote:p", settings=self.providers[0].settings)


def _gen(rid: str = "r1", tier: str = "standard", prompt: list[int] | None = None,
         target: Target = Target.LOCAL) -> GenerationRequest:
    if target is Target.RELAY:  # not tokenized here: no tokens, no engine parameters
        return GenerationRequest(request_id=rid, target=target, tier=tier, model="local-m")
    return GenerationRequest(request_id=rid, prompt_token_ids=[1, 2, 3] if prompt is None else prompt,
                             sampling=SamplingParams(max_tokens=8), tier=tier, model="local-m")


def _router(side: Side, queue: MemoryQueue, local: Local, clock: Clock | None = None,
            **routing: object) -> tuple[Router, Remote, Metrics]:
    metrics = Metrics()
    remote = Remote(metrics)
    rs = RoutingSettings(**routing)  # type: ignore[arg-type]
    est = WaitEstimator(side, queue, TIERS, rs, clock=clock or Clock())
    acc = Accountant(metrics, UsageStore(), MemoryLimiter(LimitSettings()), est, {})
    return Router(local=local, remote=remote, side=side, estimator=est, accountant=acc, routing=rs,
                  metrics=metrics), remote, metrics


def _decisions(metrics: Metrics, tier: str, backend: str, reason: str) -> float:
    return metrics.decisions.labels(tier, backend, reason)._value.get()


async def test_local_when_the_wait_is_within_the_target():
    router, remote, metrics = _router(Side([WorkerStats(capacity=2)]), await _queue(), local := Local())
    stream = await router.submit(_gen())
    assert local.submitted == ["r1"] and not remote.submitted and stream.backend == "local"
    assert _decisions(metrics, "standard", "local", "local") == 1


async def test_over_the_target_goes_remote_and_pro_stays_local():
    clock = Clock()
    router, remote, metrics = _router(Side(), await _queue(standard=7), local := Local(), clock=clock)
    clock.t += 10
    for _ in range(20):
        router.estimator.completed_local(10)  # 2/s: standard waits 8 / 2 = 4 s > 2 s; pro 1 / 2 s < 10 s
    assert (await router.submit(_gen("s", "standard"))).backend == "remote:p"
    assert (await router.submit(_gen("p", "pro"))).backend == "local"
    assert remote.submitted == ["s"] and local.submitted == ["p"]
    assert _decisions(metrics, "standard", "remote", "queue_wait") == 1


async def test_a_batch_line_stays_local_when_an_interactive_request_would_overflow():
    clock = Clock()
    router, remote, metrics = _router(Side(), await _queue(standard=7), local := Local(), clock=clock)
    clock.t += 10
    for _ in range(20):
        router.estimator.completed_local(10)  # standard waits 4 s > its 2 s target
    line = _gen("line", "standard")
    line.batch = True
    assert (await router.submit(line)).backend == "local"
    assert (await router.submit(_gen("s", "standard"))).backend == "remote:p"
    assert local.submitted == ["line"] and remote.submitted == ["s"]
    assert _decisions(metrics, "standard", "local", "batch") == 1
    router, remote, _ = _router(Side([WorkerStats(capacity=8)]), await _queue(), Local(full=True))
    line.batch = True
    with pytest.raises(QueueFull):  # the runner retries it; no provider's online price
        await router.submit(line)
    assert not remote.submitted


async def test_remote_only_no_worker_and_queue_full():
    router, remote, metrics = _router(Side(ready=False), await _queue(), Local())
    await router.submit(_gen("a", target=Target.RELAY))  # not tokenized here: the local side cannot take it
    assert _decisions(metrics, "standard", "remote", "no_worker") == 1
    router.side.model = "another"  # type: ignore[attr-defined]
    await router.submit(_gen("b", target=Target.RELAY))
    assert _decisions(metrics, "standard", "remote", "remote_only") == 1
    router, remote, metrics = _router(Side([WorkerStats(capacity=8)]), await _queue(), Local(full=True))
    assert (await router.submit(_gen("c"))).backend == "remote:p"
    assert _decisions(metrics, "standard", "remote", "queue_full") == 1


async def test_prefill_ahead_in_a_busy_engine_overflows_a_request_despite_free_slots():
    clock = Clock()
    worker = WorkerStats(capacity=64, in_flight=40)
    router, remote, metrics = _router(Side([worker]), await _queue(), local := Local(), clock=clock)
    _busy_engine(clock, router.estimator, worker, 500, 2000)  # 4 s of prefill ahead: past standard's 2 s
    assert (await router.submit(_gen("s", "standard"))).backend == "remote:p"
    assert (await router.submit(_gen("p", "pro"))).backend == "local"  # within pro's 10 s
    assert remote.submitted == ["s"] and local.submitted == ["p"]
    assert _decisions(metrics, "standard", "remote", "queue_wait") == 1


async def test_refuse_past_target_answers_429_instead_of_queueing_past_the_tier_target():
    clock = Clock()
    worker = WorkerStats(capacity=64, in_flight=40)
    router, remote, metrics = _router(Side([worker]), await _queue(), local := Local(), clock=clock,
                                      refuse_past_target=True)
    router.remote = None  # the local engine alone serves the model
    assert (await router.submit(_gen("early", "standard"))).backend == "local"  # nothing known: it queues
    _busy_engine(clock, router.estimator, worker, 500, 2000)
    with pytest.raises(APIError) as e:
        await router.submit(_gen("s", "standard"))
    assert e.value.status == 429 and e.value.code == "engines_busy" and e.value.retry_after == 3  # 4 s - 2 s, up
    assert "standard tier's 2 s target" in e.value.message
    assert (await router.submit(_gen("p", "pro"))).backend == "local"
    assert local.submitted == ["early", "p"]
    assert _decisions(metrics, "standard", "local", "refused_late") == 1
    router.routing.refuse_past_target = False  # the default: it queues
    assert (await router.submit(_gen("q", "standard"))).backend == "local"


def _queued_router(refuse: bool = False) -> tuple[Router, Remote, Metrics, MemoryQueue]:
    """A router over a real LocalBackend and in-process queue that no worker pulls from, its standard
    target 250 ms (START_BY of it: 200 ms); the estimate says "free slot" so requests are admitted."""
    metrics = Metrics()
    remote = Remote(metrics)
    queue = MemoryQueue(max_depth=100)
    tiers = {"pro": TierSettings(priority=0, max_queue_wait_ms=10_000),
             "standard": TierSettings(priority=1, max_queue_wait_ms=250)}
    rs = RoutingSettings(refuse_past_target=refuse)
    side = Side([WorkerStats(capacity=8)])
    est = WaitEstimator(side, queue, tiers, rs)
    acc = Accountant(metrics, UsageStore(), MemoryLimiter(LimitSettings()), est, {})
    router = Router(local=LocalBackend(queue), remote=remote, side=side, estimator=est, accountant=acc, routing=rs,
                    metrics=metrics)
    return router, remote, metrics, queue


async def test_a_request_still_queued_near_its_target_is_taken_back_to_a_provider():
    router, remote, metrics, queue = _queued_router()
    stream = await router.submit(_gen("s", "standard"))
    t0 = time.monotonic()
    first = await asyncio.wait_for(stream.__anext__(), 3)  # no worker takes it: at 200 ms it leaves the queue
    assert 0.15 < time.monotonic() - t0 < 1.0
    assert first.output.text == "remote" and stream.backend == "remote:p" and remote.submitted == ["s"]
    assert await queue.depth("standard") == 0
    assert _decisions(metrics, "standard", "remote", "queue_late") == 1
    await stream.aclose()


async def test_a_request_a_worker_took_stays_local_past_its_start_by_time():
    router, remote, metrics, queue = _queued_router()
    stream = await router.submit(_gen("s", "standard"))
    items = await queue.pull(8, 1.0)  # a worker takes it at once
    assert [i.request.request_id for i in items] == ["s"]
    await asyncio.sleep(0.3)  # past the start-by time: nothing to take back
    await queue.publish(RequestOutput("s", text="local", finished=True, finish_reason="stop", completion_tokens=1))
    first = await stream.__anext__()
    assert first.output.text == "local" and stream.backend == "local" and not remote.submitted
    assert _decisions(metrics, "standard", "remote", "queue_late") == 0
    await stream.aclose()


async def test_refuse_past_target_ends_a_request_still_queued_near_its_target_with_429():
    router, remote, metrics, queue = _queued_router(refuse=True)
    router.remote = None  # the local engine alone serves the model
    stream = await router.submit(_gen("s", "standard"))
    with pytest.raises(APIError) as e:
        await asyncio.wait_for(stream.__anext__(), 3)
    assert e.value.status == 429 and e.value.code == "engines_busy" and e.value.retry_after == 1
    assert await queue.depth("standard") == 0 and not remote.submitted
    assert _decisions(metrics, "standard", "local", "refused_late") == 1
    await stream.aclose()
    pro = await router.submit(_gen("p", "pro"))  # 10 s target: still queued, not taken back yet
    await asyncio.sleep(0.3)
    assert await queue.depth("pro") == 1
    await pro.aclose()


def _with(gen: GenerationRequest, **fields: object) -> GenerationRequest:
    gen.api = ChatCompletionRequest(model="local-m", messages=[{"role": "user", "content": "hi"}], **fields)
    return gen


async def test_a_field_only_an_engine_applies_keeps_the_request_off_providers():
    clock = Clock()
    router, remote, metrics = _router(Side(), await _queue(standard=7), local := Local(), clock=clock)
    clock.t += 10
    for _ in range(20):
        router.estimator.completed_local(10)  # standard waits 4 s > its 2 s target: it would overflow
    assert (await router.submit(_with(_gen("k"), top_k=5))).backend == "local"
    assert (await router.submit(_with(_gen("plain"), top_k=0))).backend == "remote:p"  # 0: off, nothing to drop
    assert local.submitted == ["k"] and remote.submitted == ["plain"]
    assert _decisions(metrics, "standard", "local", "engine_field") == 1
    router.side.model = "another"  # type: ignore[attr-defined]
    with pytest.raises(APIError) as e:  # served only by providers: refused, not relayed without it
        await router.submit(_with(_gen("r", target=Target.RELAY), ignore_eos=True))
    assert e.value.status == 400 and e.value.param == "ignore_eos" and e.value.code == "unsupported_parameter"
    gen = _with(_gen("img"), min_tokens=4)
    gen.needs_remote = "an image part"
    with pytest.raises(APIError) as e:
        await router.submit(gen)
    assert e.value.param == "min_tokens"
    assert remote.submitted == ["plain"]


# ---------------------------------------------------------------- accounting


async def test_accounting_records_what_the_response_reports():
    clock = Clock()
    router, remote, metrics = _router(Side([WorkerStats(capacity=2)]), await _queue(), clock=clock,
                                      local=Local(outputs=[
        RequestOutput("r1", text="a", completion_tokens=1, prompt_tokens=3, cached_tokens=2),
        RequestOutput("r1", text="b", completion_tokens=2, finished=True, finish_reason="stop", cached_tokens=2)]))
    stream = await router.submit(_gen(prompt=[1, 2, 3]))
    clock.t += 1
    async with stream:
        assert [ch.output.text async for ch in stream] == ["a", "b"]
    totals = (await router.accountant.usage.totals(None))["totals"]
    assert (totals["requests"], totals["prompt_tokens"], totals["cached_tokens"], totals["completion_tokens"]) == (
        1, 3, 2, 2)
    assert metrics.usage_tokens.labels("anonymous", "local-m", "local", "completion")._value.get() == 2
    assert router.estimator.completion_rate() > 0  # a local completion feeds the estimate


async def test_cost_at_the_providers_prices_or_the_local_price():
    metrics = Metrics()
    remote = Remote(metrics)
    acc = Accountant(metrics, UsageStore(), MemoryLimiter(LimitSettings()),
                     WaitEstimator(Side(), await _queue(), TIERS, RoutingSettings()),
                     {"input_per_m": 0.5, "output_per_m": 1.0})
    remote_stream = await remote.submit(_gen())
    cost, equivalent = acc.costs("m", remote_stream.provider_settings, 1_000_000, 0, 1_000_000)
    assert cost == equivalent == pytest.approx(3.0)
    assert acc.costs("m", Stream([]).provider_settings, 1_000_000, 0, 2_000_000)[0] == pytest.approx(2.5)


# ---------------------------------------------------------------- fallback


@pytest.mark.parametrize("failure,falls_back", [(Failure.ENGINE, True), (Failure.UNAVAILABLE, True),
                                                (Failure.INVALID_REQUEST, False)])
async def test_a_local_failure_before_the_first_token_falls_back(failure, falls_back):
    metrics = Metrics()
    remote = Remote(metrics)
    local = Stream([error_output("r1", failure, "x", "broke")])
    stream = FallbackStream(_gen(), local, remote, metrics)
    first = await stream.__anext__()
    assert local.closed is falls_back
    assert (first.output.text == "remote") is falls_back
    assert (stream.backend == "remote:p") is falls_back
