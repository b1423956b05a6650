"""API keys: created once, shown once, stored only as a SHA-256 hash in a JSON file.

Keys are 256-bit random strings, so a plain SHA-256 (no salt, no KDF) is enough: nobody can brute
force the preimage, and lookups stay O(1)-cheap on every request. Comparison uses
`hmac.compare_digest` so timing says nothing about how close a guess was. The file is rewritten
atomically (temp file + rename, mode 0600) and the gateway reloads it when it changes on disk, so
`sluice keys create` takes effect on a running server.

Key mode is sticky (fail closed): once a store has seen a key (at start, or created while it runs),
or found the file unreadable or corrupt, it stays in key mode for the life of the process. A keys
file that is then deleted, emptied, corrupted or left with no keys does not open the gateway: the
store reports a `problem` and the gateway refuses every authenticated route (503) until the file is
fixed. Only a restart with no keys file returns to anonymous (loopback-only) serving.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

log = logging.getLogger("sluice.keys")

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
    admin: bool = False  # may read /metrics (which needs an admin key once any key exists)

    @property
    def short_id(self) -> str:
        """A handle for `keys revoke` and the metrics' key label: enough of the hash to be unique, too
        little to matter."""
        return self.key_hash[:8]


_FIELDS = {f.name for f in fields(KeyRecord)}


class KeyStoreError(ValueError):
    pass


# "anonymous" labels the requests made without a key (when no keys exist); a key of that name would read
# as anonymous use in /v1/usage, metrics and reports.
RESERVED_NAMES = frozenset({"anonymous"})


def name_problem(name: str) -> str | None:
    """Why `name` cannot name a key (None: it can). Empty and blank names are refused: usage storage
    keeps anonymous use under the empty name."""
    if not name.strip():
        return "a key needs a name that is not empty or blank"
    if name.strip().casefold() in RESERVED_NAMES:
        return f"the key name {name.strip()!r} is reserved (it labels requests made without a key); choose another"
    return None


class KeyStore:
    """The keys file, cached in memory and reloaded when it changes on disk.

    `strict`: raise `KeyStoreError` at construction when the file exists but cannot be used (corrupt,
    unreadable), instead of starting in the locked state; `sluice serve` uses it to refuse to start.
    """

    def __init__(self, path: str | os.PathLike[str], *, strict: bool = False):
        self.path = Path(path)
        self._path = str(self.path)  # os.stat on a str: a stat per request, without pathlib's overhead
        self._records: list[KeyRecord] = []
        self._label_by_name: dict[str, str] = {}
        self._by_hash: dict[str, KeyRecord] = {}
        self._sig: object = ()  # never equal to a real signature: the next call reads the file
        self._loaded = False
        self._lock = threading.Lock()
        self.key_mode = False  # sticky: keys were seen (or the file was corrupt) since this store was made
        self.problem: str | None = None  # why the file cannot be used now (set only when that locks the gateway)
        self.reload_if_changed()
        if strict and self.problem is not None:
            raise KeyStoreError(self.problem)

    # ------------------------------------------------------------ reading

    def _signature(self) -> tuple[int, int, int] | None:
        st = os.stat(self._path)  # FileNotFoundError / other OSError: the caller decides
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def reload_if_changed(self, _quiet: bool = False) -> None:
        try:
            sig = self._signature()
        except FileNotFoundError:
            sig = None
        except OSError as e:  # e.g. EACCES: refuse (503) meanwhile, and retry on the next call
            self._set_problem(f"cannot read keys file {self.path}: {e.strerror or e}")
            self._sig = ()
            return
        if sig == self._sig:
            return
        with self._lock:
            try:
                records = self._read() if sig is not None else None
            except KeyStoreError as e:
                self.key_mode = True  # someone wrote keys here; never fall back to anonymous
                self._set_problem(str(e))
                self._records, self._by_hash, self._label_by_name = [], {}, {}
                self._sig = sig
                self._loaded = True
                return
            except OSError as e:  # e.g. EMFILE: refuse (503) meanwhile, and retry on the next call
                self._set_problem(f"cannot read keys file {self.path}: {e.strerror or e}")
                self._sig = ()
                return
            records = records or []
            if records and not self.key_mode:
                if self._loaded and not _quiet:  # keys appeared while running
                    log.warning("API keys now exist in %s: every API request needs a key from now on "
                                "(until restart, even if the file is removed)", self.path)
                self.key_mode = True
            self._records = records
            self._by_hash = {r.key_hash: r for r in records}
            self._label_by_name = {r.name: r.short_id for r in records}  # the last record of a name wins
            self._sig = sig
            self._loaded = True
            if self.key_mode and not records:
                why = "is missing" if sig is None else "holds no keys"
                self._set_problem(f"keys file {self.path} {why}, but this gateway runs with API keys")
            elif self.problem is not None:
                log.warning("keys file %s is usable again (%d keys)", self.path, len(records))
                self.problem = None

    def _set_problem(self, problem: str) -> None:
        if problem != self.problem:
            log.error("%s: refusing every API request until it is fixed (keys file problems never open "
                      "the gateway; a restart without keys does)", problem)
        self.problem = problem

    def _read(self) -> list[KeyRecord]:
        """The file's records; [] when missing or blank; KeyStoreError when corrupt."""
        try:
            raw = self.path.read_text()
        except FileNotFoundError:
            return []
        if not raw.strip():
            return []
        try:
            data = json.loads(raw)
            if not isinstance(data, dict) or not isinstance(data.get("keys", []), list):
                raise ValueError('expected {"keys": [...]}')
            records = []
            for r in data.get("keys", []):
                if not isinstance(r, dict) or not all(isinstance(r.get(k), str) for k in ("name", "tier", "key_hash")):
                    raise ValueError("a key record lacks name, tier or key_hash")
                if not r["name"].strip():
                    raise ValueError("a key record has an empty or blank name; give it a name")
                records.append(KeyRecord(**{k: v for k, v in r.items() if k in _FIELDS}))
        except (ValueError, TypeError) as e:
            raise KeyStoreError(f"keys file {self.path} is corrupt ({e})") from None
        return records

    @property
    def records(self) -> list[KeyRecord]:
        self.reload_if_changed()
        return list(self._records)

    def has_keys(self) -> bool:
        """True once any key was ever seen by this store (revoked ones count, and so does a keys file
        that was later removed or corrupted: nothing but a restart opens the door again)."""
        self.reload_if_changed()
        return self.key_mode

    def lookup(self, key: str, *, reload: bool = True) -> KeyRecord | None:
        """The live record for a presented key, or None; constant-time in the key's content.
        `reload=False`: as of the last look at the file (the caller just looked)."""
        if reload:
            self.reload_if_changed()
        digest = hash_key(key)
        match = None
        for record in self._records:  # few keys: scan all, compare each in constant time
            if hmac.compare_digest(record.key_hash, digest):
                match = record
        if match is None or match.revoked:
            return None
        return match

    def is_revoked(self, key_hash: str) -> bool:
        """True when a readable keys file says this key is revoked or no longer lists it (a missing or
        corrupt file says nothing about one key: running requests are left alone)."""
        if self.problem is not None:
            return False
        rec = self._by_hash.get(key_hash)
        return rec is None or rec.revoked

    def label_for(self, name: str) -> str:
        """A metrics label for a key name that does not reveal it: the key's short id."""
        label = self._label_by_name.get(name)
        if label is not None:
            return label
        return "n" + hashlib.sha256(name.encode("utf-8")).hexdigest()[:7]

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
        self._sig = ()  # force a reload on next read
        self.reload_if_changed(_quiet=True)

    def create(self, name: str, tier: str, admin: bool = False) -> str:
        """Store a new key's hash and return the key itself: the only time it exists in clear."""
        problem = name_problem(name)
        if problem is not None:
            raise KeyStoreError(problem)
        with self._lock:
            records = self._read()
        if any(r.name == name for r in records):
            raise KeyStoreError(f"a key named {name!r} already exists")
        key = KEY_PREFIX + secrets.token_urlsafe(32)
        records.append(KeyRecord(name=name, tier=tier, key_hash=hash_key(key), created=time.time(), admin=admin))
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
