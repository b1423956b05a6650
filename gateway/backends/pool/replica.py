"""One engine replica: a provider (the remote layer's tries, breaker and connection pool) that also
knows its load, and the room rule that decides whether another request may leave Sluice's tier queue
for it.

The room rule. An engine runs up to some number of sequences at once and queues the rest in its own
order (FIFO for most), where Sluice's tiers no longer count. So Sluice sends a replica a request only
while it has room: its requests in flight (Sluice's and others', as its metrics count them) below the
level at which its waiting queue grows. That level is learnt, not configured:
  * a poll that sees more than `HEADROOM` requests waiting sets it to the most the engine was ever seen
    running (its batch limit; a poll that catches a request between two of its steps then costs nothing,
    as running is compared with the peak, not taken as it is) plus `HEADROOM`: one request waiting in
    the engine starts the moment a slot frees, where one held in Sluice waits for the stream's end to be
    relayed, Sluice's admission and the engine's next step (at 90% load, holding every replica at its
    batch limit exactly made the standard tier's p99 time to first token 3.9x round-robin's). Not while
    requests wait in Sluice for room (overload): then the one in the engine's queue waits for a slot
    too, and its time went into every first-token estimate (0.75 s against 0.15 s), leaving the tiers
    no time to wait;
  * a poll that sees none waiting while the replica was at its level (its load, Sluice's and others',
    reached it) and Sluice had it at its level or had requests waiting for room, raises it by a quarter
    (a probe: the engine may run more, e.g. after freeing KV cache), up to `max_in_flight`; a probe too
    far shows as a queue at the next poll and is taken back. Within `PROBE_HOLD_S` of a poll that saw a
    queue, no probe reaches the load that queued then (running plus waiting): each probe past an
    engine's batch limit leaves requests in its FIFO for a whole request's time, and under sustained
    load (requests always waiting in Sluice) probing at every quiet poll put those waits in every
    tier's p99 time to first token;
  * a KV cache at `KV_FULL` or more at the last poll leaves no room (the engine would queue or preempt)
    until one of Sluice's requests on it ends.
A replica starts at `START_LEVEL` (or `max_in_flight` if lower) and probes up from there while it is
kept full (a slow start): starting at `max_in_flight` (64), a burst at start sent 22 requests to an
engine that runs 8, and the 14 in its FIFO put every first-token estimate past the targets. A replica
whose metrics cannot be read counts as failing (its breaker), and one of kind `openai` (no known
metrics) keeps `max_in_flight`.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable

from gateway.backends.pool.load import ReplicaLoad
from gateway.backends.remote.provider import Provider
from gateway.settings import EngineReplicaSettings, RoutingSettings

log = logging.getLogger("sluice.pool")

KV_FULL = 0.97  # at this share of its KV cache in use a replica takes nothing more
START_LEVEL = 8  # the room level before anything is learnt (the module's docstring)
HEADROOM = 1  # requests kept waiting in the engine beyond its batch: the next starts without a round trip
PROBE_HOLD_S = 5.0  # no probe up to the load that queued this soon after a poll saw it
PREFIX_BLOCKS = 8192  # prefix blocks remembered per replica (LRU)


class Replica(Provider):
    """A pool member: `in_flight` is Sluice's requests on it (the tries hold it); `reserved` those
    admitted but not yet sent; `load` its last polled metrics."""

    def __init__(self, settings: EngineReplicaSettings, routing: RoutingSettings,
                 on_room: Callable[[], None] = lambda: None, wanted: Callable[[], bool] = lambda: False,
                 clock: Callable[[], float] = time.monotonic):
        self._in_flight = 0
        self._on_room = on_room
        self._wanted = wanted  # requests wait in Sluice for room: a quiet engine is probed higher
        self._clock = clock
        self.queued_at = -PROBE_HOLD_S  # when a poll last saw requests waiting in the engine
        self.queued_load = 0.0  # running + waiting at that poll: more than the engine runs at once
        super().__init__(settings.as_provider(), routing)
        self.engine = settings
        self.kind = settings.kind
        self.metrics_url = settings.metrics_endpoint()
        # learnt: in flight at which its queue grows (a replica without metrics keeps max_in_flight)
        self.level = min(settings.max_in_flight, START_LEVEL) if self.metrics_url else settings.max_in_flight
        self.learnt = False
        self.load: ReplicaLoad | None = None
        self.metrics_error: str | None = None  # its /metrics refused our key: load unknown (shown in /ready)
        self.others = 0.0  # in flight on it not sent by this gateway, at the last poll
        self.ours_at_poll = 0  # Sluice's in flight on it when it was last polled
        self.peak = 0  # the most requests it was seen running at once
        self.reserved = 0
        self.polled_at = 0.0
        self.blocks: OrderedDict[int, None] = OrderedDict()  # prefix block hashes it has likely cached

    # in_flight is written by the tries (+1 when one starts, -1 when it ends): a drop frees room.
    @property
    def in_flight(self) -> int:
        return self._in_flight

    @in_flight.setter
    def in_flight(self, n: int) -> None:
        dropped = n < self._in_flight
        self._in_flight = n
        if dropped:
            self._on_room()

    # ---------------------------------------------------------------- room

    def busy(self) -> float:
        """Requests on it now as Sluice counts them: its own in flight and admitted, plus others' load."""
        return self._in_flight + self.reserved + self.others

    def has_room(self) -> bool:
        if not self.breaker.available() or time.monotonic() < self.not_before:
            return False
        if (self.load is not None and self.load.kv_usage is not None and self.load.kv_usage >= KV_FULL
                and self._in_flight + self.reserved >= self.ours_at_poll):
            return False  # full at the last poll, and none of ours has ended since
        level = self.level - HEADROOM if self.learnt and self._wanted() else self.level
        return self.busy() < min(level, self.engine.max_in_flight)

    def observe(self, load: ReplicaLoad) -> None:
        """A poll's load: learn the level (the module's docstring) and what others run on it."""
        ours = self._in_flight
        total = load.running + load.waiting
        self.others = max(0.0, total - ours)
        before = self.level
        self.peak = max(self.peak, int(load.running))
        now = self._clock()
        if load.waiting > HEADROOM:  # it queues: it runs no more than the most it was ever seen running
            self.level = max(1, self.peak) + HEADROOM
            self.learnt = True
            self.queued_at, self.queued_load = now, total
        elif (load.waiting == 0 and total + self.reserved >= self.level
              and (ours + self.reserved >= self.level or self._wanted()) and self.level < self.engine.max_in_flight):
            probe = min(self.engine.max_in_flight, self.level + max(1, self.level // 4))
            if now - self.queued_at < PROBE_HOLD_S:
                probe = min(probe, int(self.queued_load) - 1)  # not up to the load that queued just now
            self.level = max(self.level, probe)
        self.load = load
        self.ours_at_poll = ours
        self.polled_at = now
        if self.level != before:
            log.debug("replica %s: room level %d -> %d (running %g, waiting %g)", self.name, before,
                      self.level, load.running, load.waiting)
        if self.level > before or load.waiting == 0:
            self._on_room()

    # ---------------------------------------------------------------- prefix affinity

    def matched_blocks(self, hashes: list[int]) -> int:
        """How many of the request's leading prefix blocks this replica has seen recently."""
        n = 0
        for h in hashes:
            if h not in self.blocks:
                break
            n += 1
        return n

    def remember(self, hashes: list[int]) -> None:
        for h in hashes:
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        while len(self.blocks) > PREFIX_BLOCKS:
            self.blocks.popitem(last=False)

    def status(self) -> dict[str, object]:
        out = dict(super().status())
        ft = self.first_token.estimate()
        out.update(kind=self.kind, room_level=self.level, reserved=self.reserved, metrics_error=self.metrics_error,
                   first_token_s=None if ft is None else round(ft, 3),
                   load=None if self.load is None else {"running": self.load.running, "waiting": self.load.waiting,
                                                        "kv_usage": self.load.kv_usage})
        return out
