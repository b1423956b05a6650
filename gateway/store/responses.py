"""The Responses store: every stored response, its input items and the response it continues, kept per
API key in SQLite (beside the usage ledger by default), so `GET /v1/responses/{id}` and chains
(`previous_response_id`) survive a restart.

Isolation is in the key of every row: a response is found only with the key (name) that made it, so
another key gets the same "not found" as for an id that never existed. Bounded twice: rows older than
`ttl_s` are dropped, and past `max_bytes` of database (checked every 100 writes) the oldest rows go
first, their pages given back to the disk. The database runs in
WAL mode with `synchronous=NORMAL`: a committed row survives the process being killed; every call runs
on one worker thread (SQLite's connection is not shared across threads), off the event loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sqlite3
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger("sluice.store")

ANONYMOUS = "\x00anonymous"  # the owner of responses made without a key (auth off): no key name can equal it


@dataclass(frozen=True)
class StoredResponse:
    """One stored response: the Response object as last written, its input items, and the response it
    continues (None: the chain starts here)."""

    response: dict[str, Any]
    input_items: list[dict[str, Any]]
    previous_id: str | None


class ResponseStore:
    """SQLite store of responses, one row each. `path` ":memory:" keeps them in this process only."""

    def __init__(self, path: str, *, ttl_s: float = 30 * 86400, max_bytes: int = 1 << 30):
        self.path, self.ttl_s, self.max_bytes = path, ttl_s, max_bytes
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="responses-store")
        self._db: sqlite3.Connection | None = None
        self._writes = 0

    # ------------------------------------------------------------------ the worker thread's side

    def _conn(self) -> sqlite3.Connection:
        if self._db is None:
            if self.path != ":memory:":
                Path(self.path).parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o600)  # owners' conversations: 0600 like keys
                os.close(fd)
            db = sqlite3.connect(self.path, isolation_level=None)
            db.execute("PRAGMA auto_vacuum=INCREMENTAL")  # (on a new file) evicted rows' pages go back to the disk
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.execute("""CREATE TABLE IF NOT EXISTS responses (
                id TEXT PRIMARY KEY, owner TEXT NOT NULL, created REAL NOT NULL, previous_id TEXT,
                response TEXT NOT NULL, input_items TEXT NOT NULL, bytes INTEGER NOT NULL)""")
            db.execute("CREATE INDEX IF NOT EXISTS responses_created ON responses (created)")
            self._db = db
            self._expire(db)
        return self._db

    @staticmethod
    def _used(db: sqlite3.Connection) -> int:
        """Bytes of the database file in use (its pages less the free ones)."""
        pages = db.execute("PRAGMA page_count").fetchone()[0] - db.execute("PRAGMA freelist_count").fetchone()[0]
        return int(pages * db.execute("PRAGMA page_size").fetchone()[0])

    def _expire(self, db: sqlite3.Connection) -> None:
        """Drops rows past their TTL, then the oldest while the database is over max_bytes; gives the
        freed pages back to the disk."""
        cut = time.time() - self.ttl_s
        gone = db.execute("DELETE FROM responses WHERE created < ?", (cut,)).rowcount
        while self._used(db) > self.max_bytes:
            ids = db.execute("SELECT id FROM responses ORDER BY created LIMIT 256").fetchall()
            if not ids:
                break
            db.execute("BEGIN")
            db.executemany("DELETE FROM responses WHERE id = ?", ids)
            db.execute("COMMIT")
            db.execute("PRAGMA incremental_vacuum")
            gone += len(ids)
        if gone:
            db.execute("PRAGMA incremental_vacuum")
            db.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    def _put(self, owner: str, response: dict[str, Any], input_items: list[dict[str, Any]] | None,
             previous_id: str | None) -> None:
        db = self._conn()
        body = json.dumps(response, separators=(",", ":"))
        rid = response["id"]
        old = db.execute("SELECT bytes, input_items, owner, previous_id FROM responses WHERE id = ?",
                         (rid,)).fetchone()
        if old is not None and old[2] != owner:
            raise KeyError(rid)  # ids are random: never overwrite another owner's row
        items = json.dumps(input_items, separators=(",", ":")) if input_items is not None else (
            old[1] if old is not None else "[]")
        if previous_id is None and old is not None:
            previous_id = old[3]  # a rewrite (a background response finishing) keeps its place in the chain
        n = len(body) + len(items)
        db.execute("INSERT OR REPLACE INTO responses (id, owner, created, previous_id, response, input_items, bytes) "
                   "VALUES (?, ?, ?, ?, ?, ?, ?)",
                   (rid, owner, float(response.get("created_at") or time.time()), previous_id, body, items, n))
        self._writes += 1
        if self._writes % 100 == 0:  # the size cap and the TTL, checked every 100 writes
            self._expire(db)

    def _get(self, owner: str, rid: str) -> StoredResponse | None:
        row = self._conn().execute(
            "SELECT response, input_items, previous_id, created FROM responses WHERE id = ? AND owner = ?",
            (rid, owner)).fetchone()
        if row is None or row[3] < time.time() - self.ttl_s:
            return None
        return StoredResponse(json.loads(row[0]), json.loads(row[1]), row[2])

    def _delete(self, owner: str, rid: str) -> bool:
        db = self._conn()
        row = db.execute("SELECT bytes FROM responses WHERE id = ? AND owner = ?", (rid, owner)).fetchone()
        if row is None:
            return False
        db.execute("DELETE FROM responses WHERE id = ? AND owner = ?", (rid, owner))
        return True

    def _stats(self) -> tuple[int, int]:
        db = self._conn()
        return db.execute("SELECT COUNT(*) FROM responses").fetchone()[0], self._used(db)

    def _close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    # ------------------------------------------------------------------ the event loop's side

    async def _run(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def put(self, owner: str | None, response: dict[str, Any], input_items: list[dict[str, Any]] | None = None,
                  previous_id: str | None = None) -> None:
        """Writes (or rewrites) `response` for `owner`; on a rewrite, input_items and previous_id None keep
        the stored ones."""
        await self._run(self._put, owner or ANONYMOUS, response, input_items, previous_id)

    async def get(self, owner: str | None, rid: str) -> StoredResponse | None:
        """The response `rid` if `owner` made it (and it has not expired), else None."""
        return await self._run(self._get, owner or ANONYMOUS, rid)

    async def delete(self, owner: str | None, rid: str) -> bool:
        return await self._run(self._delete, owner or ANONYMOUS, rid)

    async def stats(self) -> tuple[int, int]:
        """(rows, bytes of the database in use)."""
        return await self._run(self._stats)

    async def close(self) -> None:
        await self._run(self._close)
        self._pool.shutdown(wait=True)


class RedisResponseStore:
    """The same store in Redis, for gateways that share one (a chain continues on any of them). A hash per
    response (`<prefix>:resp:<id>`) that expires after `ttl_s`; a sorted set of ids by creation time and a
    byte counter bound the total: past `max_bytes` the oldest go first."""

    def __init__(self, url: str, *, prefix: str = "sluice", ttl_s: float = 30 * 86400, max_bytes: int = 1 << 30):
        import redis.asyncio as aioredis

        self.redis: Any = aioredis.from_url(url, socket_timeout=2.0, socket_connect_timeout=2.0,
                                            decode_responses=True)
        self.prefix, self.ttl_s, self.max_bytes = prefix, ttl_s, max_bytes
        self._puts = 1  # every 1,000th write also sweeps ids past their TTL
        # ids by creation time, the bytes of each (kept after its hash expires) and their total
        self._index, self._sizes, self._size = f"{prefix}:resp-index", f"{prefix}:resp-sizes", f"{prefix}:resp-bytes"

    def _key(self, rid: str) -> str:
        return f"{self.prefix}:resp:{rid}"

    async def put(self, owner: str | None, response: dict[str, Any], input_items: list[dict[str, Any]] | None = None,
                  previous_id: str | None = None) -> None:
        owner = owner or ANONYMOUS
        rid, key = response["id"], self._key(response["id"])
        old = await self.redis.hmget(key, "owner", "bytes", "input_items", "previous_id")
        if old[0] is not None and old[0] != owner:
            raise KeyError(rid)
        body = json.dumps(response, separators=(",", ":"))
        items = json.dumps(input_items, separators=(",", ":")) if input_items is not None else (
            old[2] if old[2] is not None else "[]")
        prev = previous_id if previous_id is not None or old[3] is None else (old[3] or None)
        n = len(body) + len(items)
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(key, mapping={"owner": owner, "response": body, "input_items": items, "previous_id": prev or "",
                                "bytes": n})
        pipe.expire(key, int(self.ttl_s))
        pipe.zadd(self._index, {rid: float(response.get("created_at") or time.time())}, nx=True)
        pipe.hset(self._sizes, rid, n)
        pipe.incrby(self._size, n - (int(old[1]) if old[1] is not None else 0))
        *_, total = await pipe.execute()
        if total > self.max_bytes or not self._puts % 1000:
            await self._evict()
        self._puts += 1

    async def _drop(self, ids: list[str]) -> None:
        if not ids:
            return
        sizes = await self.redis.hmget(self._sizes, ids)
        pipe = self.redis.pipeline(transaction=True)
        pipe.delete(*[self._key(rid) for rid in ids])
        pipe.zrem(self._index, *ids)
        pipe.hdel(self._sizes, *ids)
        pipe.decrby(self._size, sum(int(n or 0) for n in sizes))
        await pipe.execute()

    async def _evict(self) -> None:
        """Ids past their TTL (their hash already expired), then the oldest until the total is within the cap."""
        await self._drop(await self.redis.zrangebyscore(self._index, "-inf", time.time() - self.ttl_s))
        while int(await self.redis.get(self._size) or 0) > self.max_bytes:
            oldest = await self.redis.zrange(self._index, 0, 63)
            if not oldest:
                await self.redis.set(self._size, 0)
                return
            await self._drop(oldest)

    async def get(self, owner: str | None, rid: str) -> StoredResponse | None:
        row = await self.redis.hmget(self._key(rid), "owner", "response", "input_items", "previous_id")
        if row[0] is None or row[0] != (owner or ANONYMOUS):
            return None
        return StoredResponse(json.loads(row[1]), json.loads(row[2]), row[3] or None)

    async def delete(self, owner: str | None, rid: str) -> bool:
        row = await self.redis.hmget(self._key(rid), "owner", "bytes")
        if row[0] is None or row[0] != (owner or ANONYMOUS):
            return False
        await self._drop([rid])
        return True

    async def stats(self) -> tuple[int, int]:
        return int(await self.redis.zcard(self._index)), int(await self.redis.get(self._size) or 0)

    async def close(self) -> None:
        await self.redis.aclose()


class AnyResponseStore(Protocol):
    """What the Responses routes need of a store (SQLite or Redis)."""

    async def put(self, owner: str | None, response: dict[str, Any], input_items: list[dict[str, Any]] | None = None,
                  previous_id: str | None = None) -> None: ...

    async def get(self, owner: str | None, rid: str) -> StoredResponse | None: ...

    async def delete(self, owner: str | None, rid: str) -> bool: ...

    async def stats(self) -> tuple[int, int]: ...

    async def close(self) -> None: ...
