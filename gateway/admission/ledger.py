"""The usage ledger: one row per finished request (time, key, tier, model, backend, prompt / cached /
completion tokens, cost and its remote-equivalent cost), kept so spend and budgets survive a restart and
`sluice usage` can report spend and savings.

Rows are appended to an in-memory batch on the request path (a list append, nothing else) and written off
it every `usage.flush_interval_s` and on shutdown, so a `kill -9` loses at most the last interval's rows.
The embedded default is SQLite (stdlib sqlite3, WAL mode, written in a worker thread); with the usage
store in Redis the rows go to a Redis stream instead (XADD, trimmed by age with MINID), while the totals
that budgets read stay in Redis's hashes as before. Rows older than `usage.retention_days` are deleted; in
SQLite their sums are first folded into an `archived` table, so the totals rebuilt at start (what
`/v1/usage` and budgets read without Redis) stay exact for the key's whole life.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import astuple, dataclass, fields
from pathlib import Path
from typing import Any

from gateway.tasks import cancel_and_wait, run_forever

log = logging.getLogger("sluice.usage")

STREAM = "sluice:usage:ledger"
PRUNE_EVERY_S = 3600.0


@dataclass(frozen=True)
class UsageRow:
    ts: float
    key: str
    tier: str
    model: str
    backend: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    cost: float
    equivalent_cost: float  # the same tokens at the remote prices (see Accountant.equivalent_cost)


ROW_FIELDS = tuple(f.name for f in fields(UsageRow))
_INTS = ("prompt_tokens", "cached_tokens", "completion_tokens")
_FLOATS = ("ts", "cost", "equivalent_cost")


def row_from_mapping(d: dict[str, Any]) -> UsageRow:
    kw: dict[str, Any] = {}
    for f in ROW_FIELDS:
        v = d[f]
        v = v.decode() if isinstance(v, bytes) else v
        kw[f] = int(v) if f in _INTS else float(v) if f in _FLOATS else str(v)
    return UsageRow(**kw)


class UsageLedger:
    """The batching and the flush loop; storage is `_write` / `_prune` / `rows` (SQLite or Redis)."""

    def __init__(self, flush_interval_s: float = 0.5, retention_days: float = 90.0):
        self.flush_interval_s = flush_interval_s
        self.retention_days = retention_days
        self._batch: list[UsageRow] = []
        self._task: asyncio.Task[None] | None = None
        self._flush_lock = asyncio.Lock()
        self._last_prune = 0.0

    def append(self, row: UsageRow) -> None:
        """On the request path: no I/O."""
        self._batch.append(row)

    @property
    def pending(self) -> int:
        return len(self._batch)

    async def flush(self) -> int:
        """Write the batch now; returns the number of rows written. On a failed write the rows stay
        queued for the next flush (and are logged)."""
        async with self._flush_lock:
            rows, self._batch = self._batch, []
            if rows:
                try:
                    await self._write(rows)
                except Exception as e:
                    log.warning("usage ledger write failed (%s: %s); %d rows kept for the next flush",
                                type(e).__name__, e, len(rows))
                    self._batch[:0] = rows
                    return 0
            now = time.time()
            if self.retention_days > 0 and now - self._last_prune >= PRUNE_EVERY_S:
                self._last_prune = now
                try:
                    await self._prune(now - self.retention_days * 86400)
                except Exception as e:
                    log.warning("usage ledger retention failed (%s: %s)", type(e).__name__, e)
            return len(rows)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="sluice-usage-ledger")

    async def _loop(self) -> None:
        await asyncio.sleep(self.flush_interval_s)
        await run_forever(self.flush, every_s=self.flush_interval_s, log=log, what="usage ledger flush")

    async def close(self) -> None:
        if self._task is not None:
            # Cancelled until it ends: a flush to Redis may absorb one cancellation (redis-py turns it
            # into a ConnectionError), which left the gateway's shutdown waiting here forever.
            await cancel_and_wait([self._task])
            self._task = None
        await self.flush()
        await self._close()

    async def _write(self, rows: list[UsageRow]) -> None:
        raise NotImplementedError

    async def _prune(self, before_ts: float) -> None:
        raise NotImplementedError

    async def _close(self) -> None:
        pass

    async def totals_by_key(self) -> dict[str, list[tuple[str, str, int, int, int, int, float]]] | None:
        """Per key, the (model, backend, requests, prompt, cached, completion, cost) records to replay into
        the usage store at start, in the order they were recorded; None: the store keeps its own totals."""
        return None


# ---------------------------------------------------------------- SQLite

_SCHEMA = """
CREATE TABLE IF NOT EXISTS usage (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    ts REAL NOT NULL, key TEXT NOT NULL, tier TEXT NOT NULL, model TEXT NOT NULL, backend TEXT NOT NULL,
    prompt_tokens INTEGER NOT NULL, cached_tokens INTEGER NOT NULL, completion_tokens INTEGER NOT NULL,
    cost REAL NOT NULL, equivalent_cost REAL NOT NULL);
CREATE INDEX IF NOT EXISTS usage_ts ON usage (ts);
CREATE TABLE IF NOT EXISTS archived (
    key TEXT NOT NULL, model TEXT NOT NULL, backend TEXT NOT NULL, requests INTEGER NOT NULL,
    prompt_tokens INTEGER NOT NULL, cached_tokens INTEGER NOT NULL, completion_tokens INTEGER NOT NULL,
    cost REAL NOT NULL, equivalent_cost REAL NOT NULL, PRIMARY KEY (key, model, backend));
"""

_ARCHIVE = """
INSERT INTO archived (key, model, backend, requests, prompt_tokens, cached_tokens, completion_tokens, cost,
                      equivalent_cost)
SELECT key, model, backend, count(*), sum(prompt_tokens), sum(cached_tokens), sum(completion_tokens), sum(cost),
       sum(equivalent_cost) FROM usage WHERE ts < ? GROUP BY key, model, backend
ON CONFLICT (key, model, backend) DO UPDATE SET
    requests = requests + excluded.requests, prompt_tokens = prompt_tokens + excluded.prompt_tokens,
    cached_tokens = cached_tokens + excluded.cached_tokens,
    completion_tokens = completion_tokens + excluded.completion_tokens, cost = cost + excluded.cost,
    equivalent_cost = equivalent_cost + excluded.equivalent_cost
"""


def _connect(path: str | Path, readonly: bool = False) -> sqlite3.Connection:
    if readonly:
        return sqlite3.connect(f"file:{Path(path)}?mode=ro", uri=True, check_same_thread=False)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: a process crash loses nothing committed
    db.executescript(_SCHEMA)
    return db


class SQLiteLedger(UsageLedger):
    def __init__(self, path: str | Path, flush_interval_s: float = 0.5, retention_days: float = 90.0):
        super().__init__(flush_interval_s, retention_days)
        self.path = Path(path)
        self._db = _connect(self.path)
        self._lock = threading.Lock()  # one writer thread at a time on the shared connection

    def _write_sync(self, rows: list[UsageRow]) -> None:
        with self._lock:
            self._db.execute("BEGIN")
            try:
                self._db.executemany(
                    f"INSERT INTO usage ({', '.join(ROW_FIELDS)}) VALUES ({', '.join('?' * len(ROW_FIELDS))})",
                    [astuple(r) for r in rows])
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    async def _write(self, rows: list[UsageRow]) -> None:
        await asyncio.to_thread(self._write_sync, rows)

    def prune_sync(self, before_ts: float) -> int:
        """Fold rows older than `before_ts` into `archived`, then delete them; returns how many."""
        with self._lock:
            self._db.execute("BEGIN")
            try:
                self._db.execute(_ARCHIVE, (before_ts,))
                n = self._db.execute("DELETE FROM usage WHERE ts < ?", (before_ts,)).rowcount
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")
        if n:
            log.info("usage ledger: %d rows past retention archived", n)
        return n

    async def _prune(self, before_ts: float) -> None:
        await asyncio.to_thread(self.prune_sync, before_ts)

    def totals_by_key_sync(self) -> dict[str, list[tuple[str, str, int, int, int, int, float]]]:
        out: dict[str, list[tuple[str, str, int, int, int, int, float]]] = {}
        with self._lock:
            for key, *rec in self._db.execute(
                    "SELECT key, model, backend, requests, prompt_tokens, cached_tokens, completion_tokens, cost "
                    "FROM archived"):
                out.setdefault(key, []).append(tuple(rec))
            # Replayed one row at a time in recording order: the float sums equal the ones the store
            # had before the restart, bit for bit.
            for key, *rec in self._db.execute(
                    "SELECT key, model, backend, 1, prompt_tokens, cached_tokens, completion_tokens, cost "
                    "FROM usage ORDER BY id"):
                out.setdefault(key, []).append(tuple(rec))
        return out

    async def totals_by_key(self) -> dict[str, list[tuple[str, str, int, int, int, int, float]]] | None:
        return await asyncio.to_thread(self.totals_by_key_sync)

    async def _close(self) -> None:
        with self._lock:
            self._db.close()


def read_sqlite(path: str | Path, since_ts: float) -> Iterator[UsageRow]:
    """Rows recorded at or after `since_ts` (a reader; safe while a gateway writes)."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"no usage ledger at {path}")
    db = _connect(path, readonly=True)
    try:
        for r in db.execute(f"SELECT {', '.join(ROW_FIELDS)} FROM usage WHERE ts >= ? ORDER BY id", (since_ts,)):
            yield UsageRow(*r)
    finally:
        db.close()


# ---------------------------------------------------------------- Redis


class RedisLedger(UsageLedger):
    """Rows in one Redis stream (entry ids are the write time in ms), trimmed by age with MINID."""

    def __init__(self, url: str, flush_interval_s: float = 0.5, retention_days: float = 90.0,
                 stream: str = STREAM):
        super().__init__(flush_interval_s, retention_days)
        import redis.asyncio as aioredis

        self.stream = stream
        self.redis = aioredis.from_url(url, socket_timeout=2.0, socket_connect_timeout=1.0)

    def _minid(self) -> str | None:
        if self.retention_days <= 0:
            return None
        return str(int((time.time() - self.retention_days * 86400) * 1000))

    async def _write(self, rows: list[UsageRow]) -> None:
        pipe = self.redis.pipeline(transaction=False)
        minid = self._minid()
        for r in rows:
            pipe.xadd(self.stream, {f: str(v) for f, v in zip(ROW_FIELDS, astuple(r))},
                      minid=minid, approximate=True)
        await pipe.execute()

    async def _prune(self, before_ts: float) -> None:
        await self.redis.xtrim(self.stream, minid=str(int(before_ts * 1000)), approximate=False)

    async def _close(self) -> None:
        await self.redis.aclose()


def read_redis(url: str, since_ts: float, stream: str = STREAM) -> Iterator[UsageRow]:
    import redis

    r = redis.Redis.from_url(url, socket_timeout=5.0, socket_connect_timeout=2.0)
    try:
        start = str(int(since_ts * 1000))
        while True:
            entries = r.xrange(stream, min=start, count=10000)
            if not entries:
                return
            for _id, data in entries:
                row = row_from_mapping({k.decode() if isinstance(k, bytes) else k: v
                                        for k, v in (data or {}).items()})
                if row.ts >= since_ts:
                    yield row
            last = entries[-1][0]
            start = "(" + (last.decode() if isinstance(last, bytes) else str(last))
    finally:
        r.close()


def make_ledger(path: str | Path | None, redis_url: str | None, *, flush_interval_s: float,
                retention_days: float) -> UsageLedger | None:
    """Redis when the usage store is in Redis, else SQLite at `path`; None: no ledger (path empty)."""
    if redis_url:
        return RedisLedger(redis_url, flush_interval_s, retention_days)
    if path:
        return SQLiteLedger(path, flush_interval_s, retention_days)
    return None


def group_report(rows: Iterable[UsageRow], by: str) -> list[dict[str, Any]]:
    """Per group (sorted by spend, largest first): requests, tokens, spend, equivalent and savings."""
    groups: dict[str, dict[str, Any]] = {}
    for r in rows:
        g = groups.setdefault(str(getattr(r, by)), {
            by: str(getattr(r, by)), "requests": 0, "prompt_tokens": 0, "cached_tokens": 0,
            "completion_tokens": 0, "spend": 0.0, "equivalent": 0.0})
        g["requests"] += 1
        g["prompt_tokens"] += r.prompt_tokens
        g["cached_tokens"] += r.cached_tokens
        g["completion_tokens"] += r.completion_tokens
        g["spend"] += r.cost
        g["equivalent"] += r.equivalent_cost
    out = sorted(groups.values(), key=lambda g: (-g["spend"], g[by]))
    for g in out:
        g["savings"] = g["equivalent"] - g["spend"]
    return out
