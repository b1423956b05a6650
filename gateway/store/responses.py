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
from typing import Any

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
        old = db.execute("SELECT bytes, input_items, owner FROM responses WHERE id = ?", (rid,)).fetchone()
        if old is not None and old[2] != owner:
            raise KeyError(rid)  # ids are random: never overwrite another owner's row
        items = json.dumps(input_items, separators=(",", ":")) if input_items is not None else (
            old[1] if old is not None else "[]")
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
        """Writes (or rewrites) `response` for `owner`; input_items None keeps the stored ones."""
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
