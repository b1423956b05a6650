"""API keys: created once, shown once, stored only as a SHA-256 hash in a JSON file.

Keys are 256-bit random strings, so a plain SHA-256 (no salt, no KDF) is enough: nobody can brute
force the preimage, and lookups stay O(1)-cheap on every request. Comparison uses
`hmac.compare_digest` so timing says nothing about how close a guess was. The file is rewritten
atomically (temp file + rename, mode 0600) and the gateway reloads it when its mtime changes, so
`sluice keys create` takes effect on a running server.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

KEY_PREFIX = "sk-sluice-"


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


@dataclass
class KeyRecord:
    name: str
    tier: str
    key_hash: str
    created: float
    revoked: bool = False

    @property
    def short_id(self) -> str:
        """A handle for `keys revoke`: enough of the hash to be unique, too little to matter."""
        return self.key_hash[:8]


class KeyStoreError(ValueError):
    pass


class KeyStore:
    """The keys file, cached in memory and reloaded when it changes on disk."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self._records: list[KeyRecord] = []
        self._by_hash: dict[str, KeyRecord] = {}
        self._mtime: float | None = None
        self._lock = threading.Lock()
        self.reload_if_changed()

    # ------------------------------------------------------------ reading

    def _stat_mtime(self) -> float | None:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return None
        return st.st_mtime_ns

    def reload_if_changed(self) -> None:
        mtime = self._stat_mtime()
        if mtime == self._mtime:
            return
        with self._lock:
            records = self._read()
            self._records = records
            self._by_hash = {r.key_hash: r for r in records}
            self._mtime = mtime

    def _read(self) -> list[KeyRecord]:
        try:
            raw = self.path.read_text()
        except FileNotFoundError:
            return []
        if not raw.strip():
            return []
        data = json.loads(raw)
        return [KeyRecord(**r) for r in data.get("keys", [])]

    @property
    def records(self) -> list[KeyRecord]:
        self.reload_if_changed()
        return list(self._records)

    def has_keys(self) -> bool:
        """True once any key was ever created (revoked ones count: revoking all keys must not open the door)."""
        return bool(self.records)

    def lookup(self, key: str) -> KeyRecord | None:
        """The live record for a presented key, or None; constant-time in the key's content."""
        self.reload_if_changed()
        digest = hash_key(key)
        match = None
        for record in self._records:  # few keys: scan all, compare each in constant time
            if hmac.compare_digest(record.key_hash, digest):
                match = record
        if match is None or match.revoked:
            return None
        return match

    # ------------------------------------------------------------ writing

    def _write(self, records: list[KeyRecord]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        payload = json.dumps({"keys": [asdict(r) for r in records]}, indent=2)
        fd, tmp = tempfile.mkstemp(prefix=".keys-", suffix=".tmp", dir=self.path.parent)
        try:
            os.fchmod(fd, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(payload)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
        self._mtime = None  # force a reload on next read
        self.reload_if_changed()

    def create(self, name: str, tier: str) -> str:
        """Store a new key's hash and return the key itself: the only time it exists in clear."""
        with self._lock:
            records = self._read()
        if any(r.name == name for r in records):
            raise KeyStoreError(f"a key named {name!r} already exists")
        key = KEY_PREFIX + secrets.token_urlsafe(32)
        records.append(KeyRecord(name=name, tier=tier, key_hash=hash_key(key), created=time.time()))
        self._write(records)
        return key

    def revoke(self, name_or_id: str) -> KeyRecord:
        with self._lock:
            records = self._read()
        matches = [r for r in records if r.name == name_or_id or r.short_id == name_or_id]
        if not matches:
            raise KeyStoreError(f"no key with name or id {name_or_id!r}")
        if len(matches) > 1:
            raise KeyStoreError(f"{name_or_id!r} matches several keys; use the name")
        matches[0].revoked = True
        self._write(records)
        return matches[0]
