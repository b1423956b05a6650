"""Redis queue: the distributed path (several gateways, several engine workers, one Redis).

Keys (prefix `sluice` by default; every key of one deployment shares it):
  {p}:q:{prio}      ZSET  queued ids of one priority, score = arrival sequence number (FIFO)
  {p}:prios         SET   priorities that may have queued items
  {p}:item:{id}     HASH  data (QueueItem JSON), tier, prio, seq, enq (server clock), deadline,
                          owner (worker id while leased, "" while queued), attempt, resume, last_seq
  {p}:depth         HASH  tier -> queued items (the bound the gateway enforces)
  {p}:leased        ZSET  leased ids, score = lease expiry (server clock)
  {p}:deadlines     ZSET  queued ids with a deadline, score = deadline (server clock)
  {p}:wake          LIST  wake tokens: `put` pushes one, a waiting worker BLPOPs it then pulls
  {p}:res:{id}      STREAM results: seq (cumulative completion tokens), tok (token ids), fin, data
  {p}:cancel        PUBSUB ids of cancelled running requests
  {p}:workers       ZSET  worker id -> last heartbeat; {p}:worker:{id} its stats (JSON, with a TTL)

Everything that must be atomic is one Lua script; all times come from Redis (`TIME`), so the
machines' clocks never have to agree.
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

from engine.request import RequestOutput
from gateway.messages import QueueItem, WorkerStats, output_from_dict, output_to_dict, queue_timeout_output
from gateway.queue.base import CancellationInbox, QueueFull, RequestQueue, Subscription
from gateway.tasks import cancel_and_wait, cancel_requested

log = logging.getLogger("sluice.queue.redis")

# ------------------------------------------------------------------------------------------ Lua

_NOW = """
local _t = redis.call('TIME')
local now = tonumber(_t[1]) + tonumber(_t[2]) / 1000000
"""

# Back into the queue at the original place, with the published tokens as `resume`.
# required_owner: '' = whoever holds it (the reaper), else only that owner's (a hand-back).
_REQUEUE = """
local function requeue(p, id, required_owner)
  local ik = p .. ':item:' .. id
  if redis.call('EXISTS', ik) == 0 then
    redis.call('ZREM', p .. ':leased', id)
    return 0
  end
  local owner = redis.call('HGET', ik, 'owner') or ''
  if owner == '' then
    redis.call('ZREM', p .. ':leased', id)
    return 0
  end
  if required_owner ~= '' and owner ~= required_owner then return 0 end
  local toks = {}
  for _, e in ipairs(redis.call('XRANGE', p .. ':res:' .. id, '-', '+')) do
    local f = e[2]
    for i = 1, #f, 2 do
      if f[i] == 'tok' and f[i + 1] ~= '' then toks[#toks + 1] = f[i + 1] end
    end
  end
  redis.call('HSET', ik, 'owner', '', 'resume', table.concat(toks, ','))
  redis.call('HINCRBY', ik, 'attempt', 1)
  redis.call('ZREM', p .. ':leased', id)
  local prio = redis.call('HGET', ik, 'prio')
  redis.call('ZADD', p .. ':q:' .. prio, tonumber(redis.call('HGET', ik, 'seq')), id)
  redis.call('SADD', p .. ':prios', prio)
  redis.call('HINCRBY', p .. ':depth', redis.call('HGET', ik, 'tier'), 1)
  redis.call('LPUSH', p .. ':wake', '1')
  redis.call('LTRIM', p .. ':wake', 0, 1023)
  return 1
end
"""

# ARGV: prefix, id, data, tier, prio, age_s, deadline_in_s ('' = none), limit
_PUT = _NOW + """
local p, id, tier, prio = ARGV[1], ARGV[2], ARGV[4], ARGV[5]
local depth = tonumber(redis.call('HGET', p .. ':depth', tier) or '0')
if depth >= tonumber(ARGV[8]) then return {0, depth} end
local ik = p .. ':item:' .. id
if redis.call('EXISTS', ik) == 1 then return {-1, depth} end
local seq = redis.call('INCR', p .. ':seq')
redis.call('HSET', ik, 'data', ARGV[3], 'tier', tier, 'prio', prio, 'seq', seq,
           'enq', tostring(now - tonumber(ARGV[6])), 'owner', '', 'attempt', 0, 'resume', '', 'last_seq', -1)
if ARGV[7] ~= '' then
  local dl = now + tonumber(ARGV[7])
  redis.call('HSET', ik, 'deadline', tostring(dl))
  redis.call('ZADD', p .. ':deadlines', dl, id)
end
redis.call('ZADD', p .. ':q:' .. prio, seq, id)
redis.call('SADD', p .. ':prios', prio)
redis.call('HINCRBY', p .. ':depth', tier, 1)
redis.call('LPUSH', p .. ':wake', '1')
redis.call('LTRIM', p .. ':wake', 0, 1023)
return {1, depth + 1}
"""

# ARGV: prefix, worker, max_items, need, lease_s, aging_s
# Returns {now, total_before, id1, data1, resume1, enq1, deadline1, ...} (items only when total >= need).
_PULL = _NOW + """
local p, worker = ARGV[1], ARGV[2]
local max_items, need = tonumber(ARGV[3]), tonumber(ARGV[4])
local lease, aging = tonumber(ARGV[5]), tonumber(ARGV[6])
local prios = redis.call('SMEMBERS', p .. ':prios')
local lists, pos, total = {}, {}, 0
for _, pr in ipairs(prios) do
  local c = redis.call('ZCARD', p .. ':q:' .. pr)
  if c == 0 then
    redis.call('SREM', p .. ':prios', pr)
  else
    total = total + c
    lists[pr] = redis.call('ZRANGE', p .. ':q:' .. pr, 0, max_items - 1)
    pos[pr] = 1
  end
end
if total == 0 then redis.call('DEL', p .. ':wake') end
if total == 0 or total < need then return {tostring(now), total} end
local enq = {}
local function enq_of(id)
  if enq[id] == nil then enq[id] = tonumber(redis.call('HGET', p .. ':item:' .. id, 'enq') or now) end
  return enq[id]
end
local picked = {}
while #picked < max_items do
  local best, best_pr, best_aged, best_enq = nil, nil, false, 0
  for pr, list in pairs(lists) do
    local id = list[pos[pr]]
    if id then
      local e = enq_of(id)
      local aged = (now - e) >= aging
      if aged then
        if (not best_aged) or e < best_enq then best, best_pr, best_aged, best_enq = id, pr, true, e end
      elseif (not best_aged) and (best == nil or tonumber(pr) < tonumber(best_pr)) then
        best, best_pr, best_enq = id, pr, e
      end
    end
  end
  if best == nil then break end
  pos[best_pr] = pos[best_pr] + 1
  picked[#picked + 1] = {best, best_pr}
end
local out = {tostring(now), total}
for _, pi in ipairs(picked) do
  local id, pr = pi[1], pi[2]
  local ik = p .. ':item:' .. id
  redis.call('ZREM', p .. ':q:' .. pr, id)
  redis.call('ZREM', p .. ':deadlines', id)
  local f = redis.call('HMGET', ik, 'data', 'resume', 'enq', 'deadline', 'tier')
  redis.call('HSET', ik, 'owner', worker)
  redis.call('ZADD', p .. ':leased', now + lease, id)
  redis.call('HINCRBY', p .. ':depth', f[5], -1)
  out[#out + 1] = id
  out[#out + 1] = f[1]
  out[#out + 1] = f[2] or ''
  out[#out + 1] = f[3] or ''
  out[#out + 1] = f[4] or ''
end
if total - #picked == 0 then redis.call('DEL', p .. ':wake') end
return out
"""

# ARGV: prefix, worker ('' = unfenced), ttl_s, final_ttl_s, then 5 per output: id, seq, fin, tok, data.
# Returns the ids this worker no longer owns (cancelled, or reclaimed after its lease expired).
_PUBLISH = """
local p, worker, ttl, final_ttl = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local lost = {}
for i = 5, #ARGV, 5 do
  local id, seq, fin, tok, data = ARGV[i], tonumber(ARGV[i + 1]), ARGV[i + 2], ARGV[i + 3], ARGV[i + 4]
  local ik = p .. ':item:' .. id
  local owner = redis.call('HGET', ik, 'owner')
  if worker ~= '' and owner ~= worker then
    lost[#lost + 1] = id
  else
    local rk = p .. ':res:' .. id
    local last = tonumber(owner and redis.call('HGET', ik, 'last_seq') or -1) or -1
    if seq > last or seq <= 0 or fin == '1' then
      redis.call('XADD', rk, '*', 'seq', seq, 'fin', fin, 'tok', tok, 'data', data)
      if owner then redis.call('HSET', ik, 'last_seq', seq) end
    end
    if fin == '1' then
      redis.call('EXPIRE', rk, final_ttl)
      redis.call('DEL', ik)
      redis.call('ZREM', p .. ':leased', id)
    else
      redis.call('EXPIRE', rk, ttl)
    end
  end
end
return lost
"""

# ARGV: prefix, worker, lease_s, ids...  -> ids no longer owned
_RENEW = _NOW + """
local p, worker, lease = ARGV[1], ARGV[2], tonumber(ARGV[3])
local lost = {}
for i = 4, #ARGV do
  local id = ARGV[i]
  if redis.call('HGET', p .. ':item:' .. id, 'owner') == worker then
    redis.call('ZADD', p .. ':leased', now + lease, id)
  else
    lost[#lost + 1] = id
  end
end
return lost
"""

# ARGV: prefix, worker, ids... -> number handed back
_RELEASE = _REQUEUE + """
local n = 0
for i = 3, #ARGV do n = n + requeue(ARGV[1], ARGV[i], ARGV[2]) end
return n
"""

_EXPIRE_FN = """
local function expire(p, id, final_ttl)
  redis.call('ZREM', p .. ':deadlines', id)
  local ik = p .. ':item:' .. id
  local f = redis.call('HMGET', ik, 'owner', 'prio', 'tier')
  if f[1] == '' and redis.call('ZREM', p .. ':q:' .. f[2], id) == 1 then
    redis.call('HINCRBY', p .. ':depth', f[3], -1)
    redis.call('DEL', ik)
    local rk = p .. ':res:' .. id
    redis.call('XADD', rk, '*', 'seq', 0, 'fin', '1', 'tok', '', 'err', 'queue_timeout')
    redis.call('EXPIRE', rk, final_ttl)
    return 1
  end
  return 0
end
"""

# ARGV: prefix, limit, final_ttl_s -> {reclaimed, expired}
_REAP = _NOW + _REQUEUE + _EXPIRE_FN + """
local p, limit, final_ttl = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local reclaimed, expired = 0, 0
for _, id in ipairs(redis.call('ZRANGEBYSCORE', p .. ':leased', '-inf', now, 'LIMIT', 0, limit)) do
  reclaimed = reclaimed + requeue(p, id, '')
end
for _, id in ipairs(redis.call('ZRANGEBYSCORE', p .. ':deadlines', '-inf', now, 'LIMIT', 0, limit)) do
  expired = expired + expire(p, id, final_ttl)
end
return {reclaimed, expired}
"""

# ARGV: prefix, id, final_ttl_s -> 1 when the item was still queued (now dropped with a queue_timeout result)
_EXPIRE = _EXPIRE_FN + """
return expire(ARGV[1], ARGV[2], tonumber(ARGV[3]))
"""

# ARGV: prefix, id -> 'queued' | 'running' | 'unknown'
_CANCEL = """
local p, id = ARGV[1], ARGV[2]
local ik = p .. ':item:' .. id
local f = redis.call('HMGET', ik, 'owner', 'prio', 'tier')
if f[1] == '' then
  if redis.call('ZREM', p .. ':q:' .. f[2], id) == 1 then
    redis.call('HINCRBY', p .. ':depth', f[3], -1)
  end
  redis.call('ZREM', p .. ':deadlines', id)
  redis.call('DEL', ik)
  return 'queued'
end
redis.call('DEL', ik)
redis.call('ZREM', p .. ':leased', id)
redis.call('PUBLISH', p .. ':cancel', id)
if f[1] then return 'running' end
return 'unknown'
"""

_DEPTH = """
local p = ARGV[1]
if ARGV[2] ~= '' then return tonumber(redis.call('HGET', p .. ':depth', ARGV[2]) or '0') end
local n = 0
for _, pr in ipairs(redis.call('SMEMBERS', p .. ':prios')) do n = n + redis.call('ZCARD', p .. ':q:' .. pr) end
return n
"""


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
        self._buf: deque[RequestOutput] = deque()
        self.duplicates_dropped = 0

    def _accept(self, fields: dict[str, str]) -> None:
        seq = int(fields.get("seq", "0"))
        fin = fields.get("fin") == "1"
        # seq = cumulative completion tokens. Outputs that carry no token (seq 0) are not numbered.
        if self._finished or (not fin and 0 < seq <= self._last_seq):
            self.duplicates_dropped += 1
            return
        if "err" in fields:
            out: RequestOutput = queue_timeout_output(self.request_id)
        else:
            out = output_from_dict(json.loads(fields["data"]))
        self._last_seq = max(self._last_seq, seq)
        self._finished = fin
        self._buf.append(out)

    async def get(self, timeout: float | None = None) -> RequestOutput:
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
        self._put, self._pull, self._publish = s(_PUT), s(_PULL), s(_PUBLISH)
        self._renew, self._release, self._reap = s(_RENEW), s(_RELEASE), s(_REAP)
        self._cancel, self._depth, self._expire = s(_CANCEL), s(_DEPTH), s(_EXPIRE)
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
                                          self.depth_limit(item.tier)])
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
                item.request.arrival_time = item.enqueued_at
            item.deadline = None if not deadline else local_now + (float(deadline) - server_now)
            if resume:
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

    async def depth(self, tier: str | None = None) -> int:
        return int(await self._depth(args=[self.prefix, tier or ""]))

    # ------------------------------------------------------------ results

    async def subscribe(self, request_id: str) -> Subscription:
        return _RedisSubscription(self, request_id)

    def _publish_args(self, outputs: list[RequestOutput]) -> list[Any]:
        args: list[Any] = []
        for out in outputs:
            args += [out.request_id, int(out.completion_tokens), "1" if out.finished else "0",
                     ",".join(str(t) for t in out.token_ids), json.dumps(output_to_dict(out))]
        return args

    async def publish(self, output: RequestOutput) -> None:
        await self.publish_batch([output], fenced=False)

    async def publish_batch(self, outputs: list[RequestOutput], *, fenced: bool = True) -> list[str]:
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
