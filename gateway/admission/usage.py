"""Usage and cost: every finished request adds its tokens and cost to its key's totals.

Totals are kept per key, broken down by model and backend (`local` or `remote:<provider>`).
`GET /v1/usage` returns the calling key's totals; the same figures go to Prometheus counters. With
Redis configured (the limits' Redis) totals live in one hash per key, so every gateway sees the same
numbers and a key's budget holds across gateways; otherwise in memory, rebuilt at start from the usage
ledger (gateway/admission/ledger.py) so a restart forgets neither spend nor budgets.

Budgets: a request reserves its worst-case cost at admission (`reserve`: refused when the key's spend
plus what its requests in flight hold has reached the budget) and `record` settles it to the real
cost, so a burst cannot overshoot a budget by more than one request's cost. In Redis the check and the
hold are one Lua script (atomic across gateways) and the settlement is one MULTI with the spend; a hold
that is never settled (its gateway killed) expires after `reservation_ttl_s`, while the holding gateway
renews its live ones.

When Redis is unreachable the totals a request adds are kept here (pending, summed into what this gateway
reads) and `problem` is set, so admission refuses metered requests until they reach Redis; what is
still pending at shutdown goes to the spill file (admission/spill.py), taken in at the next start.
Spend that cannot be read (Redis down) raises `SpendUnavailable`: a budget never fails open.

Anonymous use (no keys exist) is key None, a bucket no API key can share; `ANON` is only its label.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from gateway.admission.ledger import IMPORTED_SET, TotalsByKey, drop_idle_connections
from gateway.admission.outage import Outage, Recovery
from gateway.admission.spill import Spill, SpillBatch
from gateway.tasks import cancel_and_wait

log = logging.getLogger("sluice.usage")

FIELDS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "cost")
ANON = "anonymous"  # the label of anonymous use (metrics, /v1/usage); its bucket is key None
RETRY_S = 1.0  # how often pending totals are retried, and the renewal checked
RECOVER_EVERY_S = 0.25  # at most this often a refused request tries to end an outage itself

Flat = dict[str, float]

# KEYS: the key's totals hash, its holds (a sorted set: "request_id|amount" scored by expiry).
# ARGV: now, budget, member, expiry, this gateway's spend not yet in Redis, the set's TTL in ms.
_RESERVE = """
local now = tonumber(ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
local spent = tonumber(redis.call('HGET', KEYS[1], 'total|cost') or '0') + tonumber(ARGV[5])
local held = 0
for _, m in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do
  held = held + tonumber(string.match(m, '|([^|]+)$'))
end
if spent + held >= tonumber(ARGV[2]) then
  return {0, tostring(spent), tostring(held)}
end
redis.call('ZADD', KEYS[2], ARGV[4], ARGV[3])
redis.call('PEXPIRE', KEYS[2], ARGV[6])
return {1, tostring(spent), tostring(held)}
"""


class SpendUnavailable(Exception):
    """A key's spend cannot be read or reserved now (Redis unreachable): refuse, never fail open."""


@dataclass(frozen=True)
class Hold:
    """What `reserve` found: `ok` the request's worst-case cost is now held; `spent` and `held` (by the
    key's other requests in flight) as checked against the budget."""

    ok: bool
    spent: float
    held: float


@dataclass
class _Live:
    key: str | None
    amount: float
    member: str = ""  # Redis: the sorted-set member
    renewed: float = field(default_factory=time.monotonic)


def _empty() -> dict[str, float]:
    return {f: 0 for f in FIELDS}


def _shape(flat: Flat) -> dict[str, Any]:
    """{"total|model|backend|field": n} -> the /v1/usage body."""
    out: dict[str, Any] = {"totals": _empty(), "by_model": {}, "by_backend": {}}
    for k, v in flat.items():
        parts = k.split("|")
        if parts[0] == "total" and len(parts) == 2:
            out["totals"][parts[1]] = v
        elif parts[0] in ("model", "backend") and len(parts) == 3:
            group = out["by_model" if parts[0] == "model" else "by_backend"]
            group.setdefault(parts[1], _empty())[parts[2]] = v
    for group in [out["totals"], *out["by_model"].values(), *out["by_backend"].values()]:
        for f in FIELDS:
            group[f] = round(float(group[f]), 10) if f == "cost" else int(group[f])
        group["total_tokens"] = group["prompt_tokens"] + group["completion_tokens"]
    return out


def _add(into: dict[str | None, Flat], key: str | None, deltas: Flat) -> None:
    acc = into.setdefault(key, {})
    for f, v in deltas.items():
        acc[f] = acc.get(f, 0) + v


def _deltas_of(rec: dict[str, Any]) -> Flat:
    return {str(k): float(v) for k, v in rec["deltas"].items()}


def totals_name(key: str | None) -> str:
    """The Redis hash of a key's totals (anonymous: a name no key's hash can have)."""
    return "sluice:usage-anonymous" if key is None else f"sluice:usage:{key}"


def holds_name(key: str | None) -> str:
    return "sluice:usage-holds-anonymous" if key is None else f"sluice:usage-holds:{key}"


class UsageStore:
    def __init__(self, redis_url: str | None = None, *, spill: Spill | None = None,
                 reservation_ttl_s: float = 600.0):
        # Memory: the totals. Redis: totals recorded here that have not reached Redis yet.
        self._mem: dict[str | None, Flat] = {}
        self._spilled: dict[str | None, Flat] = {}  # in the spill file, not yet in Redis (counted, not pushed)
        self._spill_waiting = False  # the spill file holds batches not taken in yet
        self._settle: list[tuple[str | None, str]] = []  # holds to drop in Redis with the pending totals
        self._live: dict[str, _Live] = {}  # request id -> its hold
        self.spill = spill
        self.reservation_ttl_s = reservation_ttl_s
        self._outage = Outage("usage totals in Redis", log)
        self._task: asyncio.Task[None] | None = None
        self._recovery = Recovery(self._recover, RECOVER_EVERY_S)
        self.redis = None
        if redis_url:
            import redis.asyncio as aioredis

            self.redis = aioredis.from_url(redis_url, socket_timeout=1.0, socket_connect_timeout=1.0)
            self._reserve = self.redis.register_script(_RESERVE)

    @property
    def problem(self) -> str | None:
        """Why spend cannot be recorded now (admission refuses metered requests); None: it can."""
        return self._outage.problem

    @staticmethod
    def _deltas(model: str, backend: str, prompt: int, cached: int, completion: int,
                cost: float, requests: int = 1) -> Flat:
        vals = {"requests": requests, "prompt_tokens": prompt, "cached_tokens": cached,
                "completion_tokens": completion, "cost": cost}
        out: Flat = {}
        for scope in ("total", f"model|{model}", f"backend|{backend}"):
            for f, v in vals.items():
                out[f"{scope}|{f}"] = v
        return out

    @staticmethod
    def _incr(pipe: Any, key: str | None, deltas: Flat) -> None:
        name = totals_name(key)
        for f, v in deltas.items():
            if f.endswith("|cost"):
                pipe.hincrbyfloat(name, f, float(v))
            else:
                pipe.hincrby(name, f, int(v))

    # ------------------------------------------------------------ recording

    async def record(self, key: str | None, model: str, backend: str, prompt: int, cached: int,
                     completion: int, cost: float, *, request_id: str | None = None) -> None:
        """Add a finished request's usage; settles its hold (`request_id`) in the same step. Never raises:
        with Redis unreachable the totals stay pending here (and the gateway refuses metered requests)."""
        deltas = self._deltas(model, backend, prompt, cached, completion, cost)
        live = self._live.pop(request_id, None) if request_id is not None else None
        if self.redis is None:
            _add(self._mem, key, deltas)
            return
        if self._mem or self.problem is not None:  # an outage: queue behind what is already pending
            self._keep(key, deltas, live)
            return
        try:
            pipe = self.redis.pipeline(transaction=True)  # the spend and the end of its hold, all or nothing
            self._incr(pipe, key, deltas)
            if live is not None:
                pipe.zrem(holds_name(key), live.member)
            await pipe.execute()
        except Exception as e:
            self._keep(key, deltas, live)
            self._outage.failed(f"recording usage failed ({type(e).__name__}: {e})", self._pending_text())
            await drop_idle_connections(self.redis)  # the next try (a retry, a request) gets a fresh one

    def _keep(self, key: str | None, deltas: Flat, live: _Live | None) -> None:
        _add(self._mem, key, deltas)
        if live is not None:
            self._settle.append((live.key, live.member))

    def _pending_text(self) -> str:
        n = sum(int(d.get("total|requests", 0)) for d in self._mem.values())
        return f"{n} requests' usage pending"

    async def _push(self) -> None:
        """Send the pending totals (and the settlement of their holds) to Redis in one MULTI."""
        assert self.redis is not None
        if self._spill_waiting:
            await self._take_spill()
        if not self._mem and not self._settle:
            await self.redis.ping()
            return
        pending, self._mem = self._mem, {}
        settle, self._settle = self._settle, []
        try:
            pipe = self.redis.pipeline(transaction=True)
            for key, deltas in pending.items():
                self._incr(pipe, key, deltas)
            for key, member in settle:
                pipe.zrem(holds_name(key), member)
            await pipe.execute()
        except BaseException:
            for key, deltas in pending.items():  # back, with whatever was recorded meanwhile
                _add(self._mem, key, deltas)
            self._settle[:0] = settle
            raise

    # ------------------------------------------------------------ the spill

    async def open(self) -> None:
        """At start: take in the totals a previous run could not send to Redis (and drop its holds)."""
        if self.redis is None or self.spill is None:
            return
        batches = await asyncio.to_thread(self.spill.batches)
        for b in batches:
            for rec in b.records:
                if "deltas" in rec:
                    _add(self._spilled, rec.get("key"), _deltas_of(rec))
        self._spill_waiting = bool(batches)
        if batches:
            try:
                await self._take_spill()
            except Exception as e:  # retried by the maintenance loop; admission waits for it
                self._outage.failed(f"taking in the spill file {self.spill.path} failed ({type(e).__name__}: {e})")

    async def _take_spill(self) -> None:
        """The spill file's batches not taken in yet, with their ids, in one MULTI; then out of the file."""
        assert self.redis is not None and self.spill is not None
        batches: list[SpillBatch] = await asyncio.to_thread(self.spill.batches)
        if batches:
            ids = [b.id for b in batches]
            done = {b for b, f in zip(ids, await self.redis.smismember(IMPORTED_SET, ids)) if f}
            fresh = [b for b in batches if b.id not in done]
            if fresh:
                pipe = self.redis.pipeline(transaction=True)
                for b in fresh:
                    for rec in b.records:
                        if "deltas" in rec:
                            self._incr(pipe, rec.get("key"), _deltas_of(rec))
                        elif "release" in rec:  # a hold its gateway could not settle
                            pipe.zrem(holds_name(rec.get("key")), str(rec["release"]))
                    pipe.sadd(IMPORTED_SET, b.id)
                await pipe.execute()
                log.info("usage totals: %d records taken in from the spill file %s",
                         sum(len(b.records) for b in fresh), self.spill.path)
            try:
                await asyncio.to_thread(self.spill.remove, set(ids))
            except OSError as e:  # taken in and remembered: the next try drops them
                log.warning("usage totals: could not rewrite the spill file %s (%s)", self.spill.path, e)
        self._spilled = {}
        self._spill_waiting = False

    def _save_or_report(self) -> None:
        """At shutdown: totals that never reached Redis go to the spill file (with the holds they could not
        settle), else are reported lost."""
        holds = [*self._settle, *((h.key, h.member) for h in self._live.values() if h.member)]
        if not self._mem and not holds:
            return
        records: list[dict[str, Any]] = [{"key": k, "deltas": d} for k, d in self._mem.items()]
        records += [{"key": k, "release": member} for k, member in holds]
        n = sum(int(d.get("total|requests", 0)) for d in self._mem.values())
        if self.spill is not None:
            try:
                self.spill.append(records)
                log.warning("usage totals: %d requests' usage (and %d budget holds) could not reach Redis; saved to "
                            "%s, taken in at the next start", n, len(holds), self.spill.path)
                return
            except OSError as e:
                why = f"the spill file {self.spill.path} failed: {e}"
        else:
            why = "no spill file is configured"
        if not self._mem:
            return  # holds only: they expire by themselves
        lost = "; ".join(f"{ANON if k is None else k}: {int(d.get('total|requests', 0))} requests, cost "
                         f"{d.get('total|cost', 0.0):.6f}" for k, d in self._mem.items())
        log.error("usage totals: %d requests' usage LOST, not recorded in Redis (%s): %s", n, why, lost)

    # ------------------------------------------------------------ budgets

    async def reserve(self, key: str | None, budget: float, request_id: str, amount: float) -> Hold:
        """Hold `amount` (a request's worst-case cost) unless the key's spend plus its holds already reach
        `budget`. Raises SpendUnavailable when that cannot be checked."""
        if self.redis is None:
            spent = float(self._mem.get(key, {}).get("total|cost", 0.0))
            held = sum(h.amount for h in self._live.values() if h.key == key)
            if spent + held >= budget:
                return Hold(False, spent, held)
            self._live[request_id] = _Live(key, amount)
            return Hold(True, spent, held)
        if self.problem is not None:
            raise SpendUnavailable(self.problem)
        member = f"{request_id}|{amount!r}"
        now = time.time()
        local = self._mem.get(key, {}).get("total|cost", 0.0) + self._spilled.get(key, {}).get("total|cost", 0.0)
        try:
            ok, spent, held = await self._reserve(
                keys=[totals_name(key), holds_name(key)],
                args=[now, budget, member, now + self.reservation_ttl_s, local,
                      int(self.reservation_ttl_s * 2000)])
        except Exception as e:
            raise SpendUnavailable(f"{type(e).__name__}: {e}") from None
        if int(ok) != 1:
            return Hold(False, float(spent), float(held))
        self._live[request_id] = _Live(key, amount, member)
        return Hold(True, float(spent), float(held))

    async def release(self, request_id: str) -> None:
        """Drop a hold with nothing to record (the request failed before any output); no-op when settled."""
        live = self._live.pop(request_id, None)
        if live is None or self.redis is None:
            return
        try:
            await self.redis.zrem(holds_name(live.key), live.member)
        except Exception:  # it expires anyway; the next push drops it
            self._settle.append((live.key, live.member))

    async def _renew(self) -> None:
        """Keep this gateway's live holds from expiring while their requests run."""
        assert self.redis is not None
        now = time.monotonic()
        due = [h for h in self._live.values() if now - h.renewed >= self.reservation_ttl_s / 3]
        if not due:
            return
        pipe = self.redis.pipeline(transaction=False)
        expiry = time.time() + self.reservation_ttl_s
        for h in due:
            pipe.zadd(holds_name(h.key), {h.member: expiry}, xx=True)
            pipe.pexpire(holds_name(h.key), int(self.reservation_ttl_s * 2000))
        await pipe.execute()
        for h in due:
            h.renewed = now

    # ------------------------------------------------------------ reading

    def restore(self, by_key: TotalsByKey) -> None:
        """Replay the ledger's records, (model, backend, requests, prompt, cached, completion, cost) per key,
        into the in-memory totals, in the order `record` added them (so the sums are the same floats)."""
        for key, recs in by_key.items():
            acc = self._mem.setdefault(key, {})
            for model, backend, n, prompt, cached, completion, cost in recs:
                for f, v in self._deltas(model, backend, prompt, cached, completion, cost, n).items():
                    acc[f] = acc.get(f, 0) + v

    async def _flat(self, key: str | None) -> Flat:
        flat = dict(self._mem.get(key, {}))
        if self.redis is not None:
            for f, v in self._spilled.get(key, {}).items():
                flat[f] = flat.get(f, 0) + v
            try:
                raw = await self.redis.hgetall(totals_name(key))
            except Exception as e:
                raise SpendUnavailable(f"{type(e).__name__}: {e}") from None
            for raw_key, raw_value in raw.items():
                name = raw_key.decode() if isinstance(raw_key, bytes) else str(raw_key)
                flat[name] = flat.get(name, 0) + float(raw_value)
        return flat

    async def totals(self, key: str | None) -> dict[str, Any]:
        return _shape(await self._flat(key))

    async def spent(self, key: str | None) -> float:
        return float((await self._flat(key)).get("total|cost", 0.0))

    async def recover_now(self) -> bool:
        """On admission while failing: send what is pending now (see outage.Recovery); True when spend
        can be recorded."""
        if self.problem is None:
            return True
        if self.redis is None:
            return False
        return await self._recovery()

    async def _recover(self) -> bool:
        try:
            await self._push()
        except Exception as e:
            self._outage.failed(f"recording usage failed ({type(e).__name__}: {e})", self._pending_text())
            await drop_idle_connections(self.redis)
            return False
        self._outage.recovered()
        return True

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        if self.redis is not None and self._task is None:
            self._task = asyncio.create_task(self._maintain(), name="sluice-usage-totals")

    async def _maintain(self) -> None:
        """While Redis fails: send the pending totals every RETRY_S (admitting again once they are in);
        always: renew the live holds."""
        while True:
            await asyncio.sleep(min(RETRY_S, self.reservation_ttl_s / 3))
            if self._mem or self._settle or self._spill_waiting or self.problem is not None:
                try:
                    await self._push()
                    self._outage.recovered()
                except asyncio.CancelledError:
                    raise
                except Exception as e:
                    self._outage.failed(f"recording usage failed ({type(e).__name__}: {e})", self._pending_text())
                    await drop_idle_connections(self.redis)
                    continue
            try:
                await self._renew()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.debug("renewing budget holds failed (%s)", type(e).__name__)

    async def close(self) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task])
            self._task = None
        if self.redis is None:
            return
        if self._mem or self._settle:
            try:
                await self._push()
            except Exception as e:
                self._outage.failed(f"recording usage failed ({type(e).__name__}: {e})", self._pending_text())
        if not self._mem and not self._settle:
            for rid in list(self._live):  # requests cut off by the shutdown: nothing more to record
                await self.release(rid)
        await asyncio.to_thread(self._save_or_report)
        await self.redis.aclose()
