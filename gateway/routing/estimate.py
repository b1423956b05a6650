"""How long until a new request's first token on the local engines? The router's overflow decision and
the `sluice_queue_wait_estimate_seconds` gauge both ask this. Two parts: the wait for a slot, and then the
prefill ahead of its first token inside a busy engine.

A request waits for the completions that free a slot for it, so
    wait = need / completion_rate,   need = ahead + 1 - free_slots   (0 when need <= 0)
where `ahead` is what is queued in tiers of the same or a higher priority, `free_slots` the engines'
unused capacity and `completion_rate` the local completions per second over the last
`routing.completion_window_s`. When completions are scarce (fewer than `MIN_COMPLETIONS` in the
window: a cold start, or long requests holding every slot) the rate comes from the engine instead:
    wait = need * tokens_per_request * step_seconds / capacity
with `step_seconds` measured from the workers' step counters (and busy time), `tokens_per_request` the
average completion of past local requests (else the `max_tokens` of those running now). With neither
known and no free slot the wait is unknown (infinite: overflow).

A slot is not a first token: an engine running dozens of sequences prefills a new prompt in chunks that
share its steps with the others' decodes, after the prompts admitted before it (under sustained load
standard requests met free slots at once yet saw a p99 time to first token of 9 s). So the estimate adds
    prefill = (pending + ahead * prompt_tokens_per_request + own prompt) / prefill_rate + step_seconds
where `pending` is the prompt tokens the engines hold and have not computed (`WorkerStats.prefill_pending`)
and `prefill_rate` the rate at which they compute prompt tokens while such work is pending (sampled from
their `prefill_tokens` counters; an interval that begins with none pending says nothing of it). Until a
rate is measured the term is 0 (the slot wait alone).

Work of a higher priority that arrives while a request waits goes ahead of it too (a pro request queued
after a standard one is served first). So the slot wait divides `need` by the completion rate left over
after the higher tiers' local arrival rate (over the same window):
    wait = need / (completion_rate - higher_rate)
and is unknown (infinite: overflow) when they leave it less than `MIN_SHARE` of the rate. Without this,
at 3x capacity with 30% pro (pro alone 0.9x), standard requests admitted on a short queue were passed by
every pro arrival and saw a p99 time to first token of 10 s against a 3 s target.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable

from gateway.queue.base import RequestQueue
from gateway.routing.capacity import LocalSide
from gateway.settings import RoutingSettings, TierSettings

MIN_COMPLETIONS = 3  # fewer local completions in the window: estimate from the engine's step rate
MIN_SHARE = 0.05  # the least share of the completion rate a tier counts on beside higher tiers' arrivals


class WaitEstimator:
    def __init__(self, local: LocalSide, queue: RequestQueue, tiers: dict[str, TierSettings],
                 routing: RoutingSettings, clock: Callable[[], float] = time.monotonic):
        self.local = local
        self.queue = queue
        self.tiers = tiers
        self.window_s = routing.completion_window_s
        self._clock = clock
        self._started = clock()
        self._completions: deque[float] = deque()
        self._starts: deque[tuple[float, int]] = deque()  # local requests' (start time, priority)
        self._tokens_per_request: float | None = None  # EWMA of local completions' completion tokens
        self._in_flight_max_tokens: dict[str, int] = {}  # local requests in flight: their max_tokens
        self._step_sample: tuple[float, float, float | None] | None = None  # (time, steps, busy s)
        self._step_s: float | None = None  # seconds per engine step (decaying average)
        self._step_sums = (0.0, 0.0)  # decaying (seconds, steps) behind it
        self._prompt_tokens: float | None = None  # EWMA of local requests' prompt tokens
        self._prefill_sample: tuple[float, float, float] | None = None  # (time, prefilled, pending)
        self._prefill_sums = (0.0, 0.0)  # decaying (tokens, seconds) while prefill work was pending
        self._prefill_rate: float | None = None  # prompt tokens per second the engines compute under load

    # ------------------------------------------------------------ what the router tells it

    def started_local(self, request_id: str, max_tokens: int, prompt_tokens: int = 0,
                      tier: str | None = None) -> None:
        self._in_flight_max_tokens[request_id] = max_tokens
        if tier is not None:
            self._starts.append((self._clock(), self._priority(tier)))
        if prompt_tokens > 0:
            p = self._prompt_tokens
            self._prompt_tokens = prompt_tokens if p is None else 0.8 * p + 0.2 * prompt_tokens

    def ended_local(self, request_id: str) -> None:
        self._in_flight_max_tokens.pop(request_id, None)

    def completed_local(self, completion_tokens: int) -> None:
        self._completions.append(self._clock())
        t = self._tokens_per_request
        self._tokens_per_request = completion_tokens if t is None else 0.8 * t + 0.2 * completion_tokens

    # ------------------------------------------------------------ the local side's state

    def free_slots(self) -> int:
        return sum(w.free_slots for w in self.local.worker_stats())

    def completion_rate(self) -> float:
        now = self._clock()
        while self._completions and now - self._completions[0] > self.window_s:
            self._completions.popleft()
        span = min(self.window_s, now - self._started)
        return len(self._completions) / span if span > 0 else 0.0

    def higher_rate(self, prio: int) -> float:
        """Local requests per second of a priority above `prio` (a lower number) over the window."""
        now = self._clock()
        while self._starts and now - self._starts[0][0] > self.window_s:
            self._starts.popleft()
        span = min(self.window_s, now - self._started)
        return sum(1 for _, p in self._starts if p < prio) / span if span > 0 else 0.0

    def sample_steps(self) -> None:
        """Update the seconds-per-step estimate from the step counters (and busy time when known)."""
        workers = self.local.worker_stats()
        if not workers:
            return
        steps = float(sum(w.steps for w in workers))
        busy_parts = [w.busy_seconds for w in workers if w.busy_seconds is not None]
        busy = sum(busy_parts) if len(busy_parts) == len(workers) else None
        now = self._clock()
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

    def sample_prefill(self) -> None:
        """Update the prefill rate from the engines' prefill counters (the module's docstring)."""
        workers = self.local.worker_stats()
        if not workers or any(w.prefill_tokens is None or w.prefill_pending is None for w in workers):
            return
        now = self._clock()
        last = self._prefill_sample
        if last is not None and now - last[0] < 0.2:
            return
        done = float(sum(w.prefill_tokens or 0 for w in workers))
        pending = float(sum(w.prefill_pending or 0 for w in workers))
        self._prefill_sample = (now, done, pending)
        if last is None or last[2] <= 0 or done < last[1]:
            return  # nothing was pending (or a worker restarted): the interval says nothing of the rate
        tokens, seconds = self._prefill_sums
        self._prefill_sums = (0.5 * tokens + (done - last[1]), 0.5 * seconds + (now - last[0]))
        if self._prefill_sums[0] > 0:
            self._prefill_rate = self._prefill_sums[0] / self._prefill_sums[1]

    def prefill_rate(self) -> float | None:
        """Prompt tokens per second the engines compute while prefill work waits (None: not measured)."""
        return self._prefill_rate

    def step_seconds(self) -> float | None:
        """The measured seconds per engine step (None until an engine has stepped while sampled)."""
        return self._step_s

    # ------------------------------------------------------------ the estimate

    def tier_target_s(self, tier: str) -> float | None:
        t = self.tiers.get(tier)
        return None if t is None or t.max_queue_wait_ms is None else t.max_queue_wait_ms / 1000

    def _priority(self, tier: str) -> int:
        t = self.tiers.get(tier)
        return t.priority if t is not None else max(x.priority for x in self.tiers.values())

    async def estimate_wait(self, tier: str, prompt_tokens: int = 0) -> float:
        """Seconds to the first token of a request of `tier` with a prompt of `prompt_tokens` (0: the
        wait alone, what a request of no known size meets)."""
        prio = self._priority(tier)
        ahead = 0
        for name, t in self.tiers.items():
            if t.priority <= prio:
                ahead += await self.queue.depth(name)
        self.sample_prefill()
        prefill = self._prefill_wait(ahead, prompt_tokens)
        need = ahead + 1 - self.free_slots()
        if need <= 0:
            return prefill
        self.sample_steps()
        rate = self.completion_rate()
        if not (len(self._completions) >= MIN_COMPLETIONS and rate > 0):
            rate = self._rate_from_steps() or rate  # completions are scarce: the engine's step rate
        if rate <= 0:
            return math.inf  # nothing known and no free slot
        left = rate - self.higher_rate(prio)  # what higher tiers' arrivals leave of it
        if left < MIN_SHARE * rate:
            return math.inf
        return need / left + prefill

    def _prefill_wait(self, ahead: int, prompt_tokens: int) -> float:
        """The prefill between a slot and the first token (the module's docstring); 0 until measured."""
        rate = self._prefill_rate
        if rate is None:
            return 0.0
        pending = sum(w.prefill_pending or 0 for w in self.local.worker_stats())
        work = pending + ahead * (self._prompt_tokens or 0.0) + prompt_tokens
        if work <= 0:
            return 0.0
        return work / rate + (self._step_s or 0.0)

    def _rate_from_steps(self) -> float | None:
        """Completions per second the engines' slots give at the measured step time (None: unknown)."""
        tokens = self._tokens_per_request
        if tokens is None and self._in_flight_max_tokens:
            tokens = sum(self._in_flight_max_tokens.values()) / len(self._in_flight_max_tokens)
        capacity = sum(w.capacity for w in self.local.worker_stats())
        if self._step_s is None or tokens is None or capacity <= 0:
            return None
        return capacity / (max(1.0, tokens) * self._step_s)
