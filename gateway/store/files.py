"""Uploaded files (`/v1/files`): their bytes on disk under a directory (beside the usage ledger by default;
a shared directory for gateways in one deployment), their metadata in SQLite there, per API key.

A file is written to a temporary name and renamed once complete, then its row is committed: a crash
leaves no half file behind a row. Like stored responses, a file is found only with the key that
uploaded it: another key gets the same "not found" as for an id that never existed.
"""

from __future__ import annotations

import os
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.store.responses import ANONYMOUS
from gateway.store.sqlite import SqliteFile


@dataclass(frozen=True)
class StoredFile:
    id: str
    owner: str
    filename: str
    purpose: str
    bytes: int
    created_at: int

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
                "filename": self.filename, "purpose": self.purpose, "status": "processed"}


class FileStore:
    def __init__(self, directory: str):
        self.dir = Path(directory)
        self.db = SqliteFile(self.dir, "files.sqlite3", (
            """CREATE TABLE IF NOT EXISTS files (id TEXT PRIMARY KEY, owner TEXT NOT NULL, filename TEXT NOT NULL,
               purpose TEXT NOT NULL, bytes INTEGER NOT NULL, created_at INTEGER NOT NULL)""",
            "CREATE INDEX IF NOT EXISTS files_owner ON files (owner, created_at)"))

    def _conn(self) -> sqlite3.Connection:
        return self.db.conn()

    def path(self, file_id: str) -> Path:
        return self.dir / f"{file_id}.data"

    def temp_path(self, file_id: str) -> Path:
        """Where an upload is written before it is complete (renamed to path() by `commit`)."""
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        return self.dir / f".{file_id}.partial"

    def _commit(self, f: StoredFile) -> None:
        os.replace(self.temp_path(f.id), self.path(f.id))
        self._conn().execute("INSERT INTO files VALUES (?, ?, ?, ?, ?, ?)",
                             (f.id, f.owner, f.filename, f.purpose, f.bytes, f.created_at))

    def _row(self, row: tuple | None) -> StoredFile | None:
        return StoredFile(*row) if row is not None else None

    def _get(self, owner: str, file_id: str) -> StoredFile | None:
        return self._row(self._conn().execute("SELECT * FROM files WHERE id = ? AND owner = ?",
                                              (file_id, owner)).fetchone())

    def _list(self, owner: str, purpose: str | None, order: str) -> list[StoredFile]:
        q = "SELECT * FROM files WHERE owner = ?" + (" AND purpose = ?" if purpose else "") + \
            f" ORDER BY created_at {'ASC' if order == 'asc' else 'DESC'}, rowid {'ASC' if order == 'asc' else 'DESC'}"
        return [StoredFile(*r) for r in self._conn().execute(q, (owner, purpose) if purpose else (owner,))]

    def _delete(self, owner: str, file_id: str) -> bool:
        db = self._conn()
        if db.execute("DELETE FROM files WHERE id = ? AND owner = ?", (file_id, owner)).rowcount == 0:
            return False
        self.path(file_id).unlink(missing_ok=True)
        return True

    async def commit(self, owner: str | None, file_id: str, filename: str, purpose: str, size: int) -> StoredFile:
        """The upload at temp_path(file_id) becomes the file `file_id` of `owner`."""
        f = StoredFile(file_id, owner or ANONYMOUS, filename, purpose, size, int(time.time()))
        await self.db.run(self._commit, f)
        return f

    async def get(self, owner: str | None, file_id: str) -> StoredFile | None:
        return await self.db.run(self._get, owner or ANONYMOUS, file_id)

    async def list(self, owner: str | None, purpose: str | None = None, order: str = "desc") -> list[StoredFile]:
        return await self.db.run(self._list, owner or ANONYMOUS, purpose, order)

    async def delete(self, owner: str | None, file_id: str) -> bool:
        return await self.db.run(self._delete, owner or ANONYMOUS, file_id)

    async def close(self) -> None:
        await self.db.close()
