"""The usage ledger: one row per finished request (time, key, tier, model, backend, prompt / cached /
completion tokens, cost and its remote-equivalent cost), kept so spend and budgets survive a restart and
`sluice usage` can report spend and savings.

Rows are appended to an in-memory batch on the request path (a list append, nothing else) and written off
it every `usage.flush_interval_s` and on shutdown, so a `kill -9` loses at most the last interval's rows.
The embedded default is SQLite (stdlib sqlite3, WAL mode, written in a worker thread); with the usage
store in Redis the rows go to a Redis stream instead (XADD, trimmed by age with MINID), while the totals
that budgets read stay in Redis's hashes. Rows older than `usage.retention_days` are deleted; in SQLite
their sums are first folded into an `archived` table, so the totals rebuilt at start (what `/v1/usage`
and budgets read without Redis) stay exact for the key's whole life.

Nothing accepted may vanish from the ledger, so a write that fails (a full disk, Redis unreachable) sets
`problem` and the gateway refuses metered requests (503 `usage_unavailable`) until spend can be recorded
again: the rows still unwritten are then only those of requests already in flight. They stay queued (at
most `max_pending_rows` in memory; beyond that, and whatever is still unwritten at shutdown, goes to the
spill file, admission/spill.py, taken in at the next start); rows that not even the spill can hold are
logged at ERROR with their count and each key's spend, never dropped silently. The SQLite ledger keeps a
reserve ("ballast") file beside it: when the disk fills, releasing it makes room for the pending rows,
and the gateway admits again once the reserve is back in place (the disk has room) and a write succeeds.
A failure is logged when it starts and when it ends, with a reminder every `REMIND_EVERY_S` in between.

The ledger, its -wal and -shm files, the ballast and the spill are created 0600: they hold key names and
spend. Anonymous use (key None) is stored as the empty key name, which no API key may have (keys.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from gateway.admission.outage import Outage, Recovery
from gateway.admission.spill import FILE_MODE, Spill, SpillBatch
from gateway.tasks import cancel_and_wait, run_forever

log = logging.getLogger("sluice.usage")

STREAM = "sluice:usage:ledger"
IMPORTED_SET = "sluice:usage:spill-batches"  # spill batches already taken in (Redis)
PRUNE_EVERY_S = 3600.0
REMIND_EVERY_S = 60.0
RECOVER_EVERY_S = 0.25  # at most this often a refused request tries to end an outage itself
ANON_STORED = ""  # anonymous use in storage: a name no key can have
ANON_SHOWN = "(anonymous)"  # ... and in reports

TotalsByKey = dict[str | None, list[tuple[str, str, int, int, int, int, float]]]


class LedgerError(RuntimeError):
    """The ledger cannot be opened or created: `sluice serve` says so in one line and exits."""


@dataclass(frozen=True)
class UsageRow:
    ts: float
    key: str | None  # the API key's name; None: anonymous use (no keys exist)
    tier: str
    model: str
    backend: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    cost: float
    equivalent_cost: float  # the same tokens at the remote prices (see Accountant.record_usage)
    batch: bool = False  # a Batch API line (priced at [batches] price_factor); rows from before it: False


ROW_FIELDS = tuple(f.name for f in fields(UsageRow))
_INTS = ("prompt_tokens", "cached_tokens", "completion_tokens")
_FLOATS = ("ts", "cost", "equivalent_cost")


def row_from_mapping(d: dict[str, Any]) -> UsageRow:
    """A row from a Redis stream entry, a spill line or a SQLite record (anonymous: None or "")."""
    kw: dict[str, Any] = {}
    for f in ROW_FIELDS:
        if f == "batch" and f not in d:  # written before the flag existed
            continue
        v = d[f]
        v = v.decode() if isinstance(v, bytes) else v
        if f == "key":
            kw[f] = None if v is None or v == ANON_STORED else str(v)
        elif f == "batch":
            kw[f] = v in (True, 1, "1", "True", "true")
        else:
            kw[f] = int(v) if f in _INTS else float(v) if f in _FLOATS else str(v)
    return UsageRow(**kw)


def _stored(row: UsageRow) -> tuple[Any, ...]:
    """The row's values as storage keeps them (anonymous: the empty key name)."""
    return tuple(ANON_STORED if f == "key" and v is None else int(v) if f == "batch" else v
                 for f, v in ((f, getattr(row, f)) for f in ROW_FIELDS))


def is_disk_full(e: BaseException) -> bool:
    """A write refused for lack of space (what the ballast file is for)."""
    if isinstance(e, OSError):
        return e.errno in (errno.ENOSPC, errno.EDQUOT)
    if isinstance(e, sqlite3.Error):
        code = getattr(e, "sqlite_errorcode", None)
        if code is not None and code & 0xFF in (sqlite3.SQLITE_FULL, sqlite3.SQLITE_IOERR):
            return True
        return "full" in str(e)
    return False


def spend_by_key(rows: Iterable[UsageRow]) -> str:
    """`key: N requests, cost C` per key, for the line that reports rows lost."""
    by: dict[str | None, list[float]] = {}
    for r in rows:
        acc = by.setdefault(r.key, [0, 0.0])
        acc[0] += 1
        acc[1] += r.cost
    return "; ".join(f"{ANON_SHOWN if k is None else k}: {int(n)} requests, cost {c:.6f}"
                     for k, (n, c) in sorted(by.items(), key=lambda kv: -kv[1][1]))


class UsageLedger:
    """The batching, the flush loop, the failure state and the spill; storage is `_write`, `_prune`,
    `_check`, `_import`, `_imported` (SQLite or Redis)."""

    def __init__(self, flush_interval_s: float = 0.5, retention_days: float = 90.0, *,
                 spill: Spill | None = None, max_pending_rows: int = 10_000):
        self.flush_interval_s = flush_interval_s
        self.retention_days = retention_days
        self.spill = spill
        self.max_pending_rows = max_pending_rows
        self._outage = Outage("usage ledger", log, REMIND_EVERY_S)
        self._batch: list[UsageRow] = []
        self._spill_waiting = False  # the spill file may hold batches to take in
        self._task: asyncio.Task[None] | None = None
        self._flush_lock = asyncio.Lock()
        self._last_prune = 0.0
        self._recovery = Recovery(self._recover, RECOVER_EVERY_S)

    def append(self, row: UsageRow) -> None:
        """On the request path: no I/O."""
        self._batch.append(row)

    @property
    def pending(self) -> int:
        return len(self._batch)

    # ------------------------------------------------------------ failure state

    @property
    def problem(self) -> str | None:
        """Why spend cannot be recorded now (admission refuses metered requests); None: it can."""
        return self._outage.problem

    def _failing(self, what: str, e: BaseException) -> None:
        self._outage.failed(f"{what} ({type(e).__name__}: {e})", f"{len(self._batch)} rows pending")

    async def _attempt(self, what: str, fn: Callable[[], Any], *, relieve: bool = True) -> bool:
        """Run one storage step; a failure sets `problem` (fail closed at once), and when the storage can
        make room for rows (SQLite: release the ballast) the step is tried once more."""
        try:
            await fn()
            return True
        except Exception as e:
            self._failing(what, e)
            if not relieve or not await self._relieve(e):
                return False
        try:
            await fn()
            return True
        except Exception as e:
            self._failing(what, e)
            return False

    # ------------------------------------------------------------ the loop

    async def open(self) -> None:
        """At start: take in what a previous run spilled, and check that spend can be recorded (else the
        gateway starts refusing metered requests, and admits once it can)."""
        self._spill_waiting = self.spill is not None and self.spill.path.exists()
        if self._spill_waiting:
            await self._attempt("taking in the spill file failed", self._take_spill)
        await self._attempt("cannot make the ledger ready", self._check, relieve=False)

    async def flush(self) -> int:
        """Write the batch now; returns the number of rows written. On a failed write the rows stay
        queued for the next flush (beyond `max_pending_rows`, in the spill file)."""
        async with self._flush_lock:
            rows = self._batch[:]  # left queued until written (appends meanwhile go after them)
            if rows:

                async def write() -> None:
                    await self._write(rows)

                if not await self._attempt("write failed", write):
                    await self._shed()
                    return 0
                del self._batch[:len(rows)]
            if self._spill_waiting and not await self._attempt("taking in the spill file failed", self._take_spill):
                return len(rows)
            if self.problem is not None and await self._attempt("still cannot write", self._check, relieve=False):
                self._outage.recovered()
            now = time.time()
            if self.retention_days > 0 and now - self._last_prune >= PRUNE_EVERY_S:
                self._last_prune = now
                try:
                    await self._prune(now - self.retention_days * 86400)
                except Exception as e:
                    log.warning("usage ledger retention failed (%s: %s)", type(e).__name__, e)
            return len(rows)

    async def recover_now(self) -> bool:
        """On admission while failing: flush now (see outage.Recovery); True when spend can be recorded."""
        if self.problem is None:
            return True
        return await self._recovery()

    async def _recover(self) -> bool:
        await self.flush()
        return self.problem is None

    async def _shed(self) -> None:
        """Keep at most `max_pending_rows` in memory: the oldest of the rest go to the spill file."""
        excess = len(self._batch) - self.max_pending_rows
        if excess <= 0 or self.spill is None:
            return
        rows = self._batch[:excess]
        try:
            await asyncio.to_thread(self.spill.append, [asdict(r) for r in rows])
        except OSError as e:
            self._failing(f"the spill file {self.spill.path} failed too", e)
            return
        del self._batch[:excess]
        self._spill_waiting = True

    async def _take_spill(self) -> None:
        """Write the spill file's batches not yet taken in (each with its id, in one transaction), then
        drop them from the file."""
        assert self.spill is not None
        batches = await asyncio.to_thread(self.spill.batches)
        if batches:
            fresh = await self._fresh(batches)
            if fresh:
                await self._import(fresh)
                log.info("usage ledger: %d rows taken in from the spill file %s",
                         sum(len(b.records) for b in fresh), self.spill.path)
            try:
                await asyncio.to_thread(self.spill.remove, {b.id for b in batches})
            except OSError as e:  # taken in and remembered: a later try drops them
                log.warning("usage ledger: could not rewrite the spill file %s (%s); retrying", self.spill.path, e)
                return
        self._spill_waiting = False

    async def _fresh(self, batches: list[SpillBatch]) -> list[SpillBatch]:
        done = await self._imported([b.id for b in batches])
        return [b for b in batches if b.id not in done]

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
        if self._batch:
            rows, self._batch = self._batch, []
            await asyncio.to_thread(self._save_or_report, rows)
        await self._close()

    def _save_or_report(self, rows: list[UsageRow]) -> None:
        """At shutdown: rows still unwritten go to the spill file; if even that fails, say exactly what
        was lost."""
        if self.spill is not None:
            try:
                self.spill.append([asdict(r) for r in rows])
                log.warning("usage ledger: %d rows could not be written (%s); saved to %s, taken in at the next "
                            "start", len(rows), self.problem or "shutting down", self.spill.path)
                return
            except OSError as e:
                why = f"the spill file {self.spill.path} failed too: {e}"
        else:
            why = "no spill file is configured"
        log.error("usage ledger: %d rows LOST, their spend is not recorded (%s; %s): %s", len(rows),
                  self.problem or "write failed", why, spend_by_key(rows))

    # ------------------------------------------------------------ storage

    async def _write(self, rows: list[UsageRow]) -> None:
        raise NotImplementedError

    async def _prune(self, before_ts: float) -> None:
        raise NotImplementedError

    async def _check(self) -> None:
        """Raises unless spend can be recorded now (run at start and, while failing, on every flush)."""

    async def _relieve(self, e: BaseException) -> bool:  # noqa: ARG002 (SQLite uses it)
        """Make room after a failed write; True when a retry may now succeed."""
        return False

    async def _import(self, batches: list[SpillBatch]) -> None:
        raise NotImplementedError

    async def _imported(self, batch_ids: list[str]) -> set[str]:
        raise NotImplementedError

    async def _close(self) -> None:
        pass

    async def totals_by_key(self) -> TotalsByKey | None:
        """Per key, the (model, backend, requests, prompt, cached, completion, cost) records to replay into
        the usage store at start, in the order they were recorded (spilled rows not yet taken in included);
        None: the store keeps its own totals."""
        return None


# ---------------------------------------------------------------- SQLite

_SCHEMA = """
CREATE TABLE IF NOT EXISTS usage (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    ts REAL NOT NULL, key TEXT NOT NULL, tier TEXT NOT NULL, model TEXT NOT NULL, backend TEXT NOT NULL,
    prompt_tokens INTEGER NOT NULL, cached_tokens INTEGER NOT NULL, completion_tokens INTEGER NOT NULL,
    cost REAL NOT NULL, equivalent_cost REAL NOT NULL, batch INTEGER NOT NULL DEFAULT 0);
CREATE INDEX IF NOT EXISTS usage_ts ON usage (ts);
CREATE TABLE IF NOT EXISTS archived (
    key TEXT NOT NULL, model TEXT NOT NULL, backend TEXT NOT NULL, requests INTEGER NOT NULL,
    prompt_tokens INTEGER NOT NULL, cached_tokens INTEGER NOT NULL, completion_tokens INTEGER NOT NULL,
    cost REAL NOT NULL, equivalent_cost REAL NOT NULL, PRIMARY KEY (key, model, backend));
CREATE TABLE IF NOT EXISTS spill_batches (id TEXT PRIMARY KEY);
CREATE TABLE IF NOT EXISTS probe (id INTEGER PRIMARY KEY CHECK (id = 1), ts REAL NOT NULL);
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

_INSERT = f"INSERT INTO usage ({', '.join(ROW_FIELDS)}) VALUES ({', '.join('?' * len(ROW_FIELDS))})"


def _private(path: Path) -> None:
    """The ledger and its -wal / -shm files 0600 (SQLite gives new -wal / -shm files the ledger's mode)."""
    for p in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        with contextlib.suppress(FileNotFoundError):
            if os.stat(p).st_mode & 0o077:
                os.chmod(p, FILE_MODE)


def _connect(path: str | Path, readonly: bool = False) -> sqlite3.Connection:
    if readonly:
        return sqlite3.connect(f"file:{Path(path)}?mode=ro", uri=True, check_same_thread=False)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    os.close(os.open(path, os.O_RDWR | os.O_CREAT, FILE_MODE))  # created 0600 before SQLite opens it
    _private(path)
    db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
    try:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: a process crash loses nothing committed
        db.executescript(_SCHEMA)
        if "batch" not in {r[1] for r in db.execute("PRAGMA table_info(usage)")}:  # a ledger from before the flag
            db.execute("ALTER TABLE usage ADD COLUMN batch INTEGER NOT NULL DEFAULT 0")
    except BaseException:
        db.close()
        raise
    _private(path)
    return db


class SQLiteLedger(UsageLedger):
    def __init__(self, path: str | Path, flush_interval_s: float = 0.5, retention_days: float = 90.0, *,
                 spill: Spill | None = None, max_pending_rows: int = 10_000, ballast_bytes: int = 0):
        super().__init__(flush_interval_s, retention_days, spill=spill, max_pending_rows=max_pending_rows)
        self.path = Path(path)
        self.ballast = self.path.with_name(self.path.name + ".ballast")
        self.ballast_bytes = ballast_bytes
        try:
            self._db = _connect(self.path)
        except (OSError, sqlite3.Error) as e:
            raise LedgerError(f"cannot open the usage ledger {self.path}: {e}") from None
        self._lock = threading.Lock()  # one writer thread at a time on the shared connection

    def _transaction(self, body: Callable[[sqlite3.Connection], Any]) -> Any:
        with self._lock:
            self._db.execute("BEGIN")
            try:
                out = body(self._db)
                self._db.execute("COMMIT")
            except BaseException:
                if self._db.in_transaction:  # a failed COMMIT may leave it open
                    with contextlib.suppress(sqlite3.Error):
                        self._db.execute("ROLLBACK")
                raise
            return out

    def _write_sync(self, rows: list[UsageRow]) -> None:
        self._transaction(lambda db: db.executemany(_INSERT, [_stored(r) for r in rows]))

    async def _write(self, rows: list[UsageRow]) -> None:
        await asyncio.to_thread(self._write_sync, rows)

    # ---- the ballast: room kept for the rows in flight when the disk fills

    def _ballast_ready(self) -> bool:
        try:
            return os.stat(self.ballast).st_size >= self.ballast_bytes
        except FileNotFoundError:
            return False

    def _make_ballast(self) -> None:
        """Allocate the reserve file (real blocks: fallocate, else zeros); raises OSError on no room."""
        tmp = self.ballast.with_name(self.ballast.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
        try:
            try:
                os.posix_fallocate(fd, 0, self.ballast_bytes)
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                chunk = b"\0" * (1 << 20)
                left = self.ballast_bytes
                while left > 0:
                    left -= os.write(fd, chunk[:left])
            os.fsync(fd)
            os.close(fd)
            fd = -1
            os.replace(tmp, self.ballast)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def _check_sync(self) -> None:
        if self.ballast_bytes > 0 and not self._ballast_ready():
            self._make_ballast()
        self._transaction(lambda db: db.execute("INSERT OR REPLACE INTO probe (id, ts) VALUES (1, ?)",
                                                (time.time(),)))

    async def _check(self) -> None:
        await asyncio.to_thread(self._check_sync)

    async def _relieve(self, e: BaseException) -> bool:
        if not is_disk_full(e) or not self.ballast.exists():
            return False
        try:
            os.unlink(self.ballast)
        except OSError:
            return False
        log.warning("usage ledger: the disk is full: released its reserve file %s (%.1f MB) so the pending rows "
                    "can be written", self.ballast, self.ballast_bytes / 1e6)
        return True

    # ---- the spill's batches

    def _imported_sync(self, batch_ids: list[str]) -> set[str]:
        with self._lock:
            return {r[0] for r in self._db.execute(
                f"SELECT id FROM spill_batches WHERE id IN ({', '.join('?' * len(batch_ids))})", batch_ids)}

    async def _imported(self, batch_ids: list[str]) -> set[str]:
        return await asyncio.to_thread(self._imported_sync, batch_ids)

    def _import_sync(self, batches: list[SpillBatch]) -> None:
        def body(db: sqlite3.Connection) -> None:
            for b in batches:
                db.executemany(_INSERT, [_stored(row_from_mapping(r)) for r in b.records])
                db.execute("INSERT INTO spill_batches (id) VALUES (?)", (b.id,))

        self._transaction(body)

    async def _import(self, batches: list[SpillBatch]) -> None:
        await asyncio.to_thread(self._import_sync, batches)

    # ---- retention and totals

    def prune_sync(self, before_ts: float) -> int:
        """Fold rows older than `before_ts` into `archived`, then delete them; returns how many."""

        def body(db: sqlite3.Connection) -> int:
            db.execute(_ARCHIVE, (before_ts,))
            return int(db.execute("DELETE FROM usage WHERE ts < ?", (before_ts,)).rowcount)

        n = int(self._transaction(body))
        if n:
            log.info("usage ledger: %d rows past retention archived", n)
        return n

    async def _prune(self, before_ts: float) -> None:
        await asyncio.to_thread(self.prune_sync, before_ts)

    def totals_by_key_sync(self) -> TotalsByKey:
        out: TotalsByKey = {}

        def add(key: str | None, rec: tuple[Any, ...]) -> None:
            out.setdefault(None if key == ANON_STORED else key, []).append(tuple(rec))

        with self._lock:
            for key, *rec in self._db.execute(
                    "SELECT key, model, backend, requests, prompt_tokens, cached_tokens, completion_tokens, cost "
                    "FROM archived"):
                add(key, rec)
            # Replayed one row at a time in recording order: the float sums equal the ones the store
            # had before the restart, bit for bit.
            for key, *rec in self._db.execute(
                    "SELECT key, model, backend, 1, prompt_tokens, cached_tokens, completion_tokens, cost "
                    "FROM usage ORDER BY id"):
                add(key, rec)
        if self.spill is not None:  # spilled by an earlier run and not yet taken in: spent all the same
            batches = self.spill.batches()
            done = self._imported_sync([b.id for b in batches]) if batches else set()
            for b in batches:
                if b.id not in done:
                    for r in map(row_from_mapping, b.records):
                        add(r.key, (r.model, r.backend, 1, r.prompt_tokens, r.cached_tokens, r.completion_tokens,
                                    r.cost))
        return out

    async def totals_by_key(self) -> TotalsByKey | None:
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
        have = {r[1] for r in db.execute("PRAGMA table_info(usage)")}
        cols = [f for f in ROW_FIELDS if f in have]  # a ledger no gateway has opened since the batch flag
        for r in db.execute(f"SELECT {', '.join(cols)} FROM usage WHERE ts >= ? ORDER BY id", (since_ts,)):
            yield row_from_mapping(dict(zip(cols, r)))
    finally:
        db.close()


# ---------------------------------------------------------------- Redis


class RedisLedger(UsageLedger):
    """Rows in one Redis stream (entry ids are the write time in ms), trimmed by age with MINID."""

    def __init__(self, url: str, flush_interval_s: float = 0.5, retention_days: float = 90.0,
                 stream: str = STREAM, *, spill: Spill | None = None, max_pending_rows: int = 10_000):
        super().__init__(flush_interval_s, retention_days, spill=spill, max_pending_rows=max_pending_rows)
        import redis.asyncio as aioredis

        self.stream = stream
        self.redis = aioredis.from_url(url, socket_timeout=2.0, socket_connect_timeout=1.0)

    def _minid(self) -> str | None:
        if self.retention_days <= 0:
            return None
        return str(int((time.time() - self.retention_days * 86400) * 1000))

    def _xadd(self, pipe: Any, rows: Iterable[UsageRow]) -> None:
        minid = self._minid()
        for r in rows:
            pipe.xadd(self.stream, {f: str(v) for f, v in zip(ROW_FIELDS, _stored(r))}, minid=minid,
                      approximate=True)

    async def _write(self, rows: list[UsageRow]) -> None:
        pipe = self.redis.pipeline(transaction=False)
        self._xadd(pipe, rows)
        await pipe.execute()

    async def _check(self) -> None:
        try:
            await self.redis.ping()
        except Exception:
            await drop_idle_connections(self.redis)  # stale after a Redis restart: try a fresh one
            await self.redis.ping()

    async def _relieve(self, e: BaseException) -> bool:  # noqa: ARG002 (the storage's hook)
        """After a Redis restart the pool's idle connections are dead: drop them, retry once."""
        await drop_idle_connections(self.redis)
        return True

    async def _imported(self, batch_ids: list[str]) -> set[str]:
        flags = await self.redis.smismember(IMPORTED_SET, batch_ids)
        return {b for b, f in zip(batch_ids, flags) if f}

    async def _import(self, batches: list[SpillBatch]) -> None:
        pipe = self.redis.pipeline(transaction=True)  # the rows and their batch ids, all or nothing
        for b in batches:
            self._xadd(pipe, map(row_from_mapping, b.records))
            pipe.sadd(IMPORTED_SET, b.id)
        await pipe.execute()

    async def _prune(self, before_ts: float) -> None:
        await self.redis.xtrim(self.stream, minid=str(int(before_ts * 1000)), approximate=False)

    async def _close(self) -> None:
        await self.redis.aclose()


async def drop_idle_connections(client: Any) -> None:
    """Close a Redis client's idle pooled connections (after a Redis restart each would fail once);
    connections in use by other tasks are left alone."""
    with contextlib.suppress(Exception):
        await client.connection_pool.disconnect(inuse_connections=False)


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


@dataclass(frozen=True)
class LedgerOptions:
    """What `make_ledger` needs beyond where the ledger lives (from `[usage]`)."""

    flush_interval_s: float = 0.5
    retention_days: float = 90.0
    spill_path: str | None = None  # None: no spill file
    max_spill_bytes: int = 64 * 1024 * 1024
    max_pending_rows: int = 10_000
    ballast_bytes: int = 0  # SQLite only


def make_ledger(path: str | Path | None, redis_url: str | None, options: LedgerOptions) -> UsageLedger | None:
    """Redis when the usage store is in Redis, else SQLite at `path`; None: no ledger (path empty).
    Raises LedgerError when the SQLite ledger cannot be opened or created."""
    spill = Spill(options.spill_path, options.max_spill_bytes) if options.spill_path else None
    kw: dict[str, Any] = {"spill": spill, "max_pending_rows": options.max_pending_rows}
    if redis_url:
        return RedisLedger(redis_url, options.flush_interval_s, options.retention_days, **kw)
    if path:
        return SQLiteLedger(path, options.flush_interval_s, options.retention_days,
                            ballast_bytes=options.ballast_bytes, **kw)
    return None


def group_report(rows: Iterable[UsageRow], by: str) -> list[dict[str, Any]]:
    """Per group (sorted by spend, largest first): requests, tokens, spend, equivalent and savings."""
    groups: dict[str, dict[str, Any]] = {}
    for r in rows:
        value = getattr(r, by)
        label = ANON_SHOWN if by == "key" and value is None else ("batch" if value else "online") if by == "batch" \
            else str(value)
        g = groups.setdefault(label, {
            by: label, "requests": 0, "prompt_tokens": 0, "cached_tokens": 0,
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
