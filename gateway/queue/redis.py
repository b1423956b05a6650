"""Redis queue: the distributed path (several gateways, several engine workers, one Redis).

Keys (prefix `sluice` by default; every key of one deployment shares it):
  {p}:q:{prio}      ZSET  queued ids of one priority, score = fair-share start tag (queue/fair.py: keys of
                          one priority share it fairly; one key's requests keep their arrival order)
  {p}:vt            HASH  priority -> virtual time (the tag of the last item pulled)
  {p}:fin:{prio}    HASH  API key name -> its latest finish tag
  {p}:prios         SET   priorities that may have queued items
  {p}:item:{id}     HASH  data (QueueItem JSON), tier, prio, seq (its start tag), fkey, cost, enq (server
                          clock), deadline, owner (worker id while leased, "" while queued), attempt, resume, last_seq
  {p}:depth         HASH  tier -> queued items (the bound the gateway enforces)
  {p}:leased        ZSET  leased ids, score = lease expiry (server clock)
  {p}:deadlines     ZSET  queued ids with a deadline, score = deadline (server clock)
  {p}:wake          LIST  wake tokens: `put` pushes one, a waiting worker BLPOPs it then pulls
  {p}:res:{id}      STREAM results: seq (cumulative completion tokens), tok (token ids), fin, data
  {p}:cancel        PUBSUB ids of cancelled running requests
  {p}:workers       ZSET  worker id -> last heartbeat; {p}:worker:{id} its stats (JSON, with a TTL)

Everything that must be atomic is one Lua script (redis_scripts.py); all times come from Redis
(`TIME`), so the machines' clocks never have to agree.
  * pull: aged items first (by arrival), then priority, FIFO within a priority (the engine
    scheduler's rule), moved to the lease set with the worker as owner, all in one round trip.
  * publish: fenced by ownership: only the lease owner may append to a request's result stream,
    outputs whose sequence number is not new are skipped (so a retried publish adds nothing), and
    the final output acknowledges the request (item and lease deleted) in the same script.
  * reap (run by every gateway and worker): expired leases go back to the queue at their original
    place, with `resume` = the tokens already published, so the retry generates only the rest;
    queued items past their deadline are dropped with a `queue_timeout` result.
  * cancel: a queued item is removed; a running one is deleted (its owner's next publish or lease
    renewal sees that) and announced on the cancel channel, which workers turn into an engine abort.
Gateways read result streams with XREAD BLOCK from the last id they saw, so a Redis restart only
delays them; they also drop outputs whose sequence number is not above the last one delivered.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import socket
import time
import uuid
from collections import deque
from typing import Any

from engine import EngineRequest, RequestOutput
from gateway.messages import (
    AnyOutput,
    QueueItem,
    WorkerStats,
    output_from_dict,
    output_to_dict,
    queue_timeout_output,
)
from gateway.queue import redis_scripts as lua
from gateway.queue.base import CancellationInbox, QueueFull, RequestQueue, Subscription
from gateway.queue.fair import item_cost
from gateway.tasks import cancel_and_wait, cancel_requested

log = logging.getLogger("sluice.queue.redis")


def make_redis_client(url: str, **kw: Any):
    """An asyncio client that retries commands across short outages (exponential backoff)."""
    import redis.asyncio as aioredis
    from redis.asyncio.retry import Retry
    from redis.backoff import ExponentialBackoff
    from redis.exceptions import ConnectionError as RConnectionError
    from redis.exceptions import TimeoutError as RTimeoutError

    kw.setdefault("retry", Retry(ExponentialBackoff(cap=0.5, base=0.02), 8))
    kw.setdefault("retry_on_error", [RConnectionError, RTimeoutError, OSError])
    kw.setdefault("socket_connect_timeout", 2.0)
    kw.setdefault("socket_keepalive", True)
    kw.setdefault("health_check_interval", 15)
    # Each open result subscription blocks one connection in XREAD (see _RedisSubscription).
    kw.setdefault("max_connections", 10_000)
    return aioredis.Redis.from_url(url, **kw)


def _now() -> float:
    return time.time()


class _RedisSubscription(Subscription):
    """Reads one request's result stream from the last id seen; drops repeated sequence numbers."""

    def __init__(self, owner: RedisQueue, request_id: str):
        self._owner = owner
        self.request_id = request_id
        self._key = owner._k("res", request_id)
        self._last_id = "0-0"
        self._last_seq = -1
        self._finished = False
        self._buf: deque[AnyOutput] = deque()
        self.duplicates_dropped = 0

    def _accept(self, fields: dict[str, str]) -> None:
        seq = int(fields.get("seq", "0"))
        fin = fields.get("fin") == "1"
        # seq = cumulative completion tokens. Outputs that carry no token (seq 0) are not numbered.
        if self._finished or (not fin and 0 < seq <= self._last_seq):
            self.duplicates_dropped += 1
            return
        if "err" in fields:
            out: AnyOutput = queue_timeout_output(self.request_id)
        else:
            out = output_from_dict(json.loads(fields["data"]))
        self._last_seq = max(self._last_seq, seq)
        self._finished = fin
        self._buf.append(out)

    async def get(self, timeout: float | None = None) -> AnyOutput:
        deadline = None if timeout is None else time.monotonic() + timeout
        r = self._owner._r
        while not self._buf:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(f"no output for {self.request_id} in {timeout}s")
            block_ms = 1000 if left is None else max(1, min(1000, int(left * 1000)))
            try:
                resp = await r.xread({self._key: self._last_id}, count=256, block=block_ms)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # Redis restarting: keep the position, retry
                if cancel_requested():
                    raise asyncio.CancelledError() from e
                log.warning("reading results of %s failed (%s); retrying", self.request_id, e)
                await asyncio.sleep(0.2)
                continue
            for _key, entries in resp or []:
                for entry_id, fields in entries:
                    self._last_id = entry_id
                    self._accept(fields)
        return self._buf.popleft()

    async def close(self) -> None:
        try:
            await self._owner._r.delete(self._key)
        except Exception:  # expiry removes it anyway
            pass


class RedisQueue(RequestQueue):
    """See the module docstring. One instance per process; `consumer_id` names it as a worker."""

    def __init__(self, url: str | None = None, *, client: Any = None, prefix: str = "sluice",
                 lease_s: float = 10.0, result_ttl_s: float = 300.0, final_ttl_s: float = 60.0,
                 reap_interval_s: float | None = None, heartbeat_ttl_s: float = 5.0,
                 consumer_id: str | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        if client is None:
            if url is None:
                raise ValueError("RedisQueue needs a url or a client")
            client = make_redis_client(url, decode_responses=True)
        self._r = client
        self.prefix = prefix
        self.lease_s = lease_s
        self.renew_interval_s = lease_s / 3
        self.result_ttl_s = result_ttl_s
        self.final_ttl_s = final_ttl_s
        self.reap_interval_s = reap_interval_s if reap_interval_s is not None else max(0.05, lease_s / 4)
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self.consumer_id = consumer_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        s = client.register_script
        self._put, self._pull, self._publish = s(lua.PUT), s(lua.PULL), s(lua.PUBLISH)
        self._renew, self._release, self._reap = s(lua.RENEW), s(lua.RELEASE), s(lua.REAP)
        self._cancel, self._depth, self._expire = s(lua.CANCEL), s(lua.DEPTH), s(lua.EXPIRE)
        self._cancelled = CancellationInbox()
        self._cancel_task: asyncio.Task | None = None
        self._reaper_task: asyncio.Task | None = None
        self.pulls = 0  # round trips of the pull script (for the fill/time measurements)
        self.reclaimed = 0
        self.expired = 0

    def _k(self, *parts: str) -> str:
        return ":".join((self.prefix, *parts))

    # ------------------------------------------------------------ background

    def start_reaper(self) -> None:
        """Reclaim expired leases and expire overdue queued items (every gateway and worker runs one)."""
        if self._reaper_task is None:
            self._reaper_task = asyncio.create_task(self._reaper_loop(), name="sluice-redis-reaper")

    async def reap_once(self) -> tuple[int, int]:
        reclaimed, expired = await self._reap(args=[self.prefix, 500, self.final_ttl_s])
        self.reclaimed += int(reclaimed)
        self.expired += int(expired)
        if reclaimed:
            log.warning("reclaimed %d requests whose lease expired (their worker died or stalled)", reclaimed)
        return int(reclaimed), int(expired)

    async def _reaper_loop(self) -> None:
        while True:
            await asyncio.sleep(self.reap_interval_s * random.uniform(0.8, 1.2))
            try:
                await self.reap_once()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("reaper: %s; retrying", e)

    async def close(self) -> None:
        await cancel_and_wait([t for t in (self._reaper_task, self._cancel_task) if t is not None])
        self._reaper_task = self._cancel_task = None
        try:
            await self._r.aclose()
        except Exception as e:  # closing anyway: the connections go with the process
            log.debug("closing the Redis client failed: %s", e)

    # ------------------------------------------------------------ requests

    async def put(self, item: QueueItem) -> None:
        now = _now()
        age = max(0.0, now - item.enqueued_at)
        deadline_in = "" if item.deadline is None else repr(item.deadline - now)
        ok, depth = await self._put(args=[self.prefix, item.request_id, json.dumps(item.to_dict()), item.tier,
                                          int(item.priority), repr(age), deadline_in,
                                          self.depth_limit(item.tier), item.key or "", repr(item_cost(item))])
        if int(ok) == 0:
            raise QueueFull(item.tier, int(depth), retry_after=max(1.0, self.max_wait_ms / 1000))
        # ok == -1: the id is already queued (a retried put whose first reply was lost): nothing to do.

    async def _pull_once(self, max_items: int, need: int) -> tuple[int, list[QueueItem]]:
        self.pulls += 1
        res = await self._pull(args=[self.prefix, self.consumer_id, max_items, need, self.lease_s, self.aging_s])
        server_now, total = float(res[0]), int(res[1])
        local_now = _now()
        items = []
        for i in range(2, len(res), 5):
            rid, data, resume, enq, deadline = res[i:i + 5]
            item = QueueItem.from_dict(json.loads(data))
            # Server times -> this machine's clock, so local deadline checks and engine aging hold.
            if enq:
                item.enqueued_at = local_now - (server_now - float(enq))
                if isinstance(item.request, EngineRequest):
                    item.request.arrival_time = item.enqueued_at
            item.deadline = None if not deadline else local_now + (float(deadline) - server_now)
            if resume and isinstance(item.request, EngineRequest):
                item.request.resume_token_ids = [int(t) for t in resume.split(",")]
            items.append(item)
        return total, items

    async def _wait_wake(self, timeout: float) -> None:
        if timeout <= 0:
            return
        # BLPOP accepts fractional seconds; the wake list is only a hint, the pull script decides.
        await self._r.blpop([self._k("wake")], timeout=max(0.001, round(timeout, 3)))

    async def pull(self, max_items: int, timeout: float | None = None, *, fill_target: int | None = None,
                   max_wait_ms: float | None = None) -> list[QueueItem]:
        fill = min(self.fill_target if fill_target is None else fill_target, max_items)
        wait_s = (self.max_wait_ms if max_wait_ms is None else max_wait_ms) / 1000
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        fill_deadline: float | None = None
        while True:
            now = time.monotonic()
            need = fill if fill_deadline is None or now < fill_deadline else 1
            total, items = await self._pull_once(max_items, need)
            if items:
                return items
            now = time.monotonic()
            if total > 0:  # some waiting, fewer than fill_target: wait for more, at most max_wait
                if fill_deadline is None:
                    fill_deadline = now + wait_s
                left = fill_deadline - now
                if left <= 0:
                    continue
                await self._wait_wake(left)
                continue
            fill_deadline = None
            if deadline is not None and now >= deadline:
                return []
            left = 1.0 if deadline is None else deadline - now
            await self._wait_wake(min(left, 1.0))

    async def depth_at_most(self, priority: int) -> int:
        prios = [int(p) for p in await self._r.smembers(self._k("prios")) if int(p) <= priority]
        if not prios:
            return 0
        pipe = self._r.pipeline(transaction=False)
        for p in prios:
            pipe.zcard(self._k("q", str(p)))
        return sum(int(n) for n in await pipe.execute())

    async def depth(self, tier: str | None = None) -> int:
        return int(await self._depth(args=[self.prefix, tier or ""]))

    # ------------------------------------------------------------ results

    async def subscribe(self, request_id: str) -> Subscription:
        return _RedisSubscription(self, request_id)

    def _publish_args(self, outputs: list[AnyOutput]) -> list[Any]:
        args: list[Any] = []
        for out in outputs:
            # An embedding output carries no tokens: sequence 0 (not numbered), nothing to resume from.
            tokens = out.token_ids if isinstance(out, RequestOutput) else []
            seq = out.completion_tokens if isinstance(out, RequestOutput) else 0
            args += [out.request_id, int(seq), "1" if out.finished else "0",
                     ",".join(str(t) for t in tokens), json.dumps(output_to_dict(out))]
        return args

    async def publish(self, output: AnyOutput) -> None:
        await self.publish_batch([output], fenced=False)

    async def publish_batch(self, outputs: list[AnyOutput], *, fenced: bool = True) -> list[str]:
        """One round trip for a step's outputs. Fenced: only requests this worker still owns."""
        if not outputs:
            return []
        worker = self.consumer_id if fenced else ""
        lost = await self._publish(args=[self.prefix, worker, self.result_ttl_s, self.final_ttl_s,
                                         *self._publish_args(outputs)])
        return list(lost)

    # ------------------------------------------------------------ leases

    async def renew(self, request_ids: list[str]) -> list[str]:
        if not request_ids:
            return []
        return list(await self._renew(args=[self.prefix, self.consumer_id, self.lease_s, *request_ids]))

    async def release(self, request_ids: list[str]) -> int:
        """Hand requests back (graceful shutdown): requeued at their place with their published tokens."""
        if not request_ids:
            return 0
        return int(await self._release(args=[self.prefix, self.consumer_id, *request_ids]))

    # ------------------------------------------------------------ cancellation

    async def expire_if_queued(self, request_id: str) -> bool:
        expired = bool(int(await self._expire(args=[self.prefix, request_id, self.final_ttl_s])))
        self.expired += expired
        return expired

    async def cancel(self, request_id: str) -> None:
        await self._cancel(args=[self.prefix, request_id])

    async def _cancel_reader(self) -> None:
        channel = self._k("cancel")
        while True:
            pubsub = self._r.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(channel)
                while True:
                    msg = await pubsub.get_message(timeout=1.0)
                    if msg and msg.get("type") == "message":
                        self._cancelled.add(msg["data"])
            except asyncio.CancelledError:
                raise
            except Exception as e:  # Redis went away: resubscribe (renewals catch what we missed)
                if cancel_requested():
                    raise asyncio.CancelledError() from e
                log.warning("cancel channel: %s; resubscribing", e)
                await asyncio.sleep(0.2)
            finally:
                try:
                    await pubsub.aclose()
                except Exception as e:  # resubscribing next: the old connection is dropped either way
                    log.debug("closing the cancel subscription failed: %s", e)

    async def start_cancel_listener(self) -> None:
        if self._cancel_task is None:
            self._cancel_task = asyncio.create_task(self._cancel_reader(), name="sluice-redis-cancel")
            await asyncio.sleep(0)

    async def next_cancellations(self, timeout: float | None = None) -> list[str]:
        await self.start_cancel_listener()
        return await self._cancelled.take(timeout)

    # ------------------------------------------------------------ workers

    async def heartbeat(self, info: WorkerStats) -> None:
        key = self._k("worker", self.consumer_id)
        ttl_ms = int(self.heartbeat_ttl_s * 1000)
        async with self._r.pipeline(transaction=True) as pipe:
            pipe.set(key, json.dumps({**info.to_dict(), "worker_id": self.consumer_id}), px=ttl_ms)
            pipe.zadd(self._k("workers"), {self.consumer_id: _now()})
            await pipe.execute()

    async def unregister(self) -> None:
        await self._r.delete(self._k("worker", self.consumer_id))
        await self._r.zrem(self._k("workers"), self.consumer_id)

    async def workers(self) -> list[WorkerStats]:
        """Live workers (heartbeat key not expired), with their stats."""
        ids = await self._r.zrange(self._k("workers"), 0, -1)
        if not ids:
            return []
        values = await self._r.mget([self._k("worker", i) for i in ids])
        alive, dead = [], []
        for wid, v in zip(ids, values):
            if v:
                alive.append(WorkerStats.from_dict(json.loads(v)))
            else:
                dead.append(wid)
        if dead:
            await self._r.zrem(self._k("workers"), *dead)
        return alive

    async def ping(self) -> bool:
        return bool(await self._r.ping())
