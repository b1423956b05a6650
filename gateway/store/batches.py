"""Batches (`/v1/batches`) and their lines' results, in SQLite beside the uploaded files, per API key.

A line's result is committed (INSERT OR IGNORE on (batch, line)) before the line counts as done, so a
gateway killed mid-batch resumes at its next start with exactly the lines that have no result, and no
line is recorded twice. Gateways sharing the directory run each batch on one of them at a time: a
runner claims it with a lease it renews, and another takes it over once the lease runs out.
"""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path
from typing import Any

from gateway.store.responses import ANONYMOUS
from gateway.store.sqlite import SqliteFile


class BatchStore:
    def __init__(self, directory: str):
        self.db = SqliteFile(Path(directory), "batches.sqlite3", (
            """CREATE TABLE IF NOT EXISTS batches (id TEXT PRIMARY KEY, owner TEXT NOT NULL, tier TEXT NOT NULL,
               created_at INTEGER NOT NULL, batch TEXT NOT NULL, runner TEXT, lease REAL)""",
            """CREATE TABLE IF NOT EXISTS results (batch_id TEXT NOT NULL, line INTEGER NOT NULL, ok INTEGER NOT NULL,
               result TEXT NOT NULL, PRIMARY KEY (batch_id, line))"""))

    def _conn(self) -> sqlite3.Connection:
        return self.db.conn()

    async def put(self, owner: str | None, tier: str, batch: dict[str, Any]) -> None:
        def put() -> None:
            self._conn().execute("INSERT OR REPLACE INTO batches VALUES (?, ?, ?, ?, ?, NULL, NULL)",
                                 (batch["id"], owner or ANONYMOUS, tier, batch["created_at"], json.dumps(batch)))
        await self.db.run(put)

    async def update(self, batch: dict[str, Any]) -> None:
        """Rewrites a stored batch (its owner and tier stay)."""
        def update() -> None:
            self._conn().execute("UPDATE batches SET batch = ? WHERE id = ?", (json.dumps(batch), batch["id"]))
        await self.db.run(update)

    async def get(self, owner: str | None, batch_id: str) -> dict[str, Any] | None:
        def get() -> dict[str, Any] | None:
            row = self._conn().execute("SELECT batch FROM batches WHERE id = ? AND owner = ?",
                                       (batch_id, owner or ANONYMOUS)).fetchone()
            return json.loads(row[0]) if row else None
        return await self.db.run(get)

    async def list_for(self, owner: str | None) -> list[dict[str, Any]]:
        """The owner's batches, newest first."""
        def list_() -> list[dict[str, Any]]:
            return [json.loads(r[0]) for r in self._conn().execute(
                "SELECT batch FROM batches WHERE owner = ? ORDER BY created_at DESC, rowid DESC",
                (owner or ANONYMOUS,))]
        return await self.db.run(list_)

    async def active(self) -> list[tuple[str, str, dict[str, Any]]]:
        """(owner, tier, batch) of every batch still to run or finish, oldest first (all owners)."""
        def active() -> list[tuple[str, str, dict[str, Any]]]:
            rows = self._conn().execute("SELECT owner, tier, batch FROM batches ORDER BY created_at, rowid")
            out = [(o, t, json.loads(b)) for o, t, b in rows]
            return [x for x in out if x[2]["status"] in ("validating", "in_progress", "finalizing", "cancelling")]
        return await self.db.run(active)

    async def claim(self, batch_id: str, runner: str, lease_s: float) -> bool:
        """Whether `runner` (one gateway's) holds the batch for the next lease_s: it held it already, or
        nobody did, or the holder's lease ran out (a gateway that died). Gateways sharing the directory
        so run each batch on one of them at a time."""
        def claim() -> bool:
            now = time.time()
            return self._conn().execute(
                "UPDATE batches SET runner = ?, lease = ? WHERE id = ? AND (runner IS NULL OR runner = ? "
                "OR lease < ?)", (runner, now + lease_s, batch_id, runner, now)).rowcount == 1
        return await self.db.run(claim)

    async def unclaim(self, batch_id: str, runner: str) -> None:
        def unclaim() -> None:
            self._conn().execute("UPDATE batches SET runner = NULL, lease = NULL WHERE id = ? AND runner = ?",
                                 (batch_id, runner))
        await self.db.run(unclaim)

    async def record(self, batch_id: str, line: int, ok: bool, result: dict[str, Any]) -> bool:
        """The line's result, once: False when it was already recorded."""
        def record() -> bool:
            return self._conn().execute("INSERT OR IGNORE INTO results VALUES (?, ?, ?, ?)",
                                        (batch_id, line, int(ok), json.dumps(result))).rowcount == 1
        return await self.db.run(record)

    async def counts(self, batch_id: str) -> tuple[int, int]:
        """(lines answered, lines that failed) of the batch, from its recorded results."""
        def counts() -> tuple[int, int]:
            row = self._conn().execute("SELECT COUNT(*), COALESCE(SUM(1 - ok), 0) FROM results WHERE batch_id = ?",
                                       (batch_id,)).fetchone()
            return int(row[0]), int(row[1])
        return await self.db.run(counts)

    async def results(self, batch_id: str) -> dict[int, tuple[bool, dict[str, Any]]]:
        def results() -> dict[int, tuple[bool, dict[str, Any]]]:
            return {line: (bool(ok), json.loads(r)) for line, ok, r in self._conn().execute(
                "SELECT line, ok, result FROM results WHERE batch_id = ?", (batch_id,))}
        return await self.db.run(results)

    async def close(self) -> None:
        await self.db.close()
