"""Which inputs the next forward embeds: the batching that suits a model without a decode loop.

An embedding request is done in one forward per input, so the only questions are which inputs share
a forward and in what order requests are served. Each step packs inputs up to `max_batch_tokens`
(real tokens: the forward computes no padding in its matmuls), from the best-ranked requests:
a request that has waited `priority_aging_s` since its last step first, then by priority (lower number
first), then first come first served. A request bigger than the budget is served in slices, one per
step, so a query that arrives behind a 2,048-input ingest waits for the step under way, never for the
whole ingest.

While requests of a better priority than the step's keep arriving (one in the last
`interactive_window_s`), the step packs only `interactive_batch_tokens`: the next query waits for a
short forward, at some cost in the bulk's throughput, paid only while queries come.

A step serves one rank of priority only: inputs of lower priority never fill what a query leaves of
the budget, because a forward's time grows with its tokens, and that time is the query's latency.
Each request's inputs are taken shortest first, so the inputs of one step have similar lengths and
the padded attention wastes little.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

AGED = -math.inf  # the priority of a request past priority_aging_s


@dataclass(eq=False)
class Pending:
    """A request's inputs (ids final: truncated where asked), and how far serving them has got."""

    request_id: str
    inputs: list[list[int]]
    priority: int
    arrival: int  # order of arrival (FIFO within a priority)
    waiting_since: float  # arrival, then the end of its last step
    dimensions: int | None = None
    order: list[int] = field(default_factory=list)  # input indices, shortest first
    taken: int = 0  # inputs of `order` already scheduled
    left: int = 0  # inputs whose vector is not yet out

    def __post_init__(self) -> None:
        self.order = sorted(range(len(self.inputs)), key=lambda i: len(self.inputs[i]))
        self.left = len(self.inputs)


@dataclass
class Step:
    rows: list[tuple[Pending, int]]  # (request, input index), shortest input first
    num_tokens: int


class EmbeddingScheduler:
    def __init__(self, max_batch_tokens: int, priority_aging_s: float, *, interactive_batch_tokens: int | None = None,
                 interactive_window_s: float = 5.0):
        self.max_batch_tokens = max_batch_tokens
        self.priority_aging_s = priority_aging_s
        # While requests of a better priority than a step's have arrived in the last interactive_window_s,
        # that step packs at most interactive_batch_tokens: a query arriving mid-step waits a short one.
        self.interactive_batch_tokens = min(interactive_batch_tokens or max_batch_tokens, max_batch_tokens)
        self.interactive_window_s = interactive_window_s
        self.pending: dict[str, Pending] = {}  # requests with inputs not yet scheduled
        self._arrivals = 0
        self._last_arrival: dict[int, float] = {}  # priority -> when a request of it last arrived

    def add(self, request_id: str, inputs: list[list[int]], priority: int, now: float,
            dimensions: int | None = None) -> Pending:
        self._arrivals += 1
        p = Pending(request_id, inputs, priority, self._arrivals, now, dimensions)
        self.pending[request_id] = p
        self._last_arrival[priority] = now
        return p

    def budget(self, priority: int, now: float) -> int:
        """The token budget of a step serving `priority`: short while better-priority requests keep coming."""
        recent = any(q < priority and now - t <= self.interactive_window_s for q, t in self._last_arrival.items())
        return self.interactive_batch_tokens if recent else self.max_batch_tokens

    def remove(self, request_id: str) -> None:
        self.pending.pop(request_id, None)

    def has_pending(self) -> bool:
        return bool(self.pending)

    def _rank(self, p: Pending, now: float) -> tuple[float, int]:
        aged = now - p.waiting_since > self.priority_aging_s
        return (AGED if aged else p.priority, p.arrival)

    def schedule(self, now: float) -> Step:
        """The next step's inputs; a request leaves `pending` once all of its inputs are scheduled."""
        ranked = sorted(self.pending.values(), key=lambda p: self._rank(p, now))
        rows: list[tuple[Pending, int]] = []
        tokens = 0
        level = self._rank(ranked[0], now)[0] if ranked else 0.0
        budget = self.budget(ranked[0].priority, now) if ranked else self.max_batch_tokens
        for p in ranked:
            if self._rank(p, now)[0] != level:
                break
            while p.taken < len(p.order):
                n = len(p.inputs[p.order[p.taken]])
                if rows and tokens + n > budget:
                    break
                rows.append((p, p.order[p.taken]))
                tokens += n
                p.taken += 1
            if p.taken == len(p.order):
                del self.pending[p.request_id]
            if tokens >= budget:
                break
        rows.sort(key=lambda r: len(r[0].inputs[r[1]]))
        return Step(rows, tokens)

    def served(self, step: Step, now: float) -> None:
        """The step ran: its requests' waits for aging start again."""
        for p, _ in step.rows:
            p.waiting_since = now
