"""Fair share between the keys of one priority: who is served next when several keys' requests wait.

Tier priority decides first (pro before standard); inside one priority, plain arrival order lets a key that
sends ten times another's traffic fill the queue, and the light key's request waits behind all of it. The
anchor is the virtual token counter of Sheng et al. (OSDI 2024, "Fairness in Serving Large Language
Models"): serve the key that has been served the fewest tokens, and lift a key that comes back from idle
to the least-served active key's count, so idling earns no credit. `FairShare` keeps that rule in the form
a priority queue can hold (start-time fair queueing): each request gets a tag when it arrives,

    start = max(virtual time, the key's last finish)      finish = start + cost

and requests leave in tag order; the virtual time is the tag of the last one served. A key's requests get
increasing tags (its own arrival order is kept) spaced by their cost, so a flood of one key spreads out in
virtual time while the other key's next request takes the current virtual time and goes ahead of the
flood's tail. With one key (or no keys: no auth) the tags increase with arrival: plain FIFO.

Cost is counted in tokens, prompt plus the most it may generate (`request_cost`): what it will take of
the engine, known when it arrives. The Redis queue keeps the same tags in its Lua scripts
(queue/redis_scripts.py: a virtual time and the keys' finish tags per priority, in Redis), so gateways
sharing one Redis share one fair order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.messages import EmbeddingRequest, QueueItem

DEFAULT_OUTPUT_TOKENS = 256  # the cost of an answer whose request sets no max_tokens


def request_cost(prompt_tokens: int, max_tokens: int | None) -> float:
    """A request's share of the engine, in tokens (at least 1)."""
    return float(max(1, prompt_tokens + (DEFAULT_OUTPUT_TOKENS if max_tokens is None else max_tokens)))


def item_cost(item: QueueItem) -> float:
    """A queued item's cost in tokens: a chat request's prompt plus the most it may generate, an embedding
    request's inputs."""
    req = item.request
    if isinstance(req, EmbeddingRequest):
        return float(max(1, sum(len(x) for x in req.inputs)))
    return request_cost(len(req.prompt_token_ids), req.sampling.max_tokens)


@dataclass
class FairShare:
    """Tags for requests of several priorities (each its own virtual clock)."""

    _virtual: dict[int, float] = field(default_factory=dict)
    _finish: dict[tuple[int, str | None], float] = field(default_factory=dict)

    def tag(self, priority: int, key: str | None, cost: float) -> float:
        """The start tag of a request arriving now: order requests of one priority by it (then arrival)."""
        v = self._virtual.get(priority, 0.0)
        start = max(v, self._finish.get((priority, key), 0.0))
        self._finish[(priority, key)] = start + max(cost, 1e-9)
        return start

    def withdraw(self, priority: int, key: str | None, start: float, cost: float) -> None:
        """The request tagged `start` left without being served (refused, cancelled): if it was its key's
        latest, the key's finish goes back (a refusal is not service), and virtual time does not move."""
        if self._finish.get((priority, key)) == start + max(cost, 1e-9):
            self._finish[(priority, key)] = start

    def served(self, priority: int, start: float) -> None:
        """The request tagged `start` leaves the queue: virtual time moves up to it."""
        v = max(self._virtual.get(priority, 0.0), start)
        self._virtual[priority] = v
        if len(self._finish) > 1024:  # keys whose finish is behind the clock count as new: forget them
            self._finish = {k: f for k, f in self._finish.items() if f > self._virtual.get(k[0], 0.0)}
