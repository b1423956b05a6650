"""One SQLite database in a directory, used from one worker thread off the event loop: what the file and
batch stores share. SQLite's connection is not shared across threads, so every call runs on the same
one; the file is created 0600 (its rows name API keys) in a 0700 directory, in WAL mode."""

from __future__ import annotations

import asyncio
import os
import sqlite3
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


class SqliteFile:
    def __init__(self, directory: Path, name: str, schema: tuple[str, ...]):
        self.dir, self.name, self.schema = directory, name, schema
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"store-{name}")
        self._db: sqlite3.Connection | None = None

    def conn(self) -> sqlite3.Connection:
        """The connection (opened, and the schema applied, on first use); on the worker thread only."""
        if self._db is None:
            self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            path = self.dir / self.name
            os.close(os.open(path, os.O_CREAT | os.O_RDWR, 0o600))
            db = sqlite3.connect(path, isolation_level=None)
            db.execute("PRAGMA journal_mode=WAL")
            for statement in self.schema:
                db.execute(statement)
            self._db = db
        return self._db

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the worker thread."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def close(self) -> None:
        def close() -> None:
            if self._db is not None:
                self._db.close()
                self._db = None
        await self.run(close)
        self._pool.shutdown(wait=True)
