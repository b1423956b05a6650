"""The usage ledger when writes fail: logged once when the failure starts and once when it ends (not every
flush), rows in memory bounded (the rest spilled), the ballast file making room on a real full disk, a
spilled batch never counted twice, rows nobody could keep reported with their spend, and every file the
ledger creates private (0600)."""

from __future__ import annotations

import asyncio
import logging
import os
import sqlite3
import stat
import time
from dataclasses import asdict

from gateway.admission.ledger import SQLiteLedger, UsageRow, read_sqlite
from gateway.admission.usage import UsageStore
from tests.fixtures.clock import Clock
from tests.gateway.admission.test_full_disk import fill, tmpfs


def _row(i: int, key: str | None = "frank", cost: float = 0.01) -> UsageRow:
    return UsageRow(time.time(), key, "pro", "m", "local", 10 + i, 0, 5, cost, cost)


def _failing(ledger: SQLiteLedger) -> None:
    async def write(rows: list[UsageRow]) -> None:
        raise sqlite3.OperationalError("database or disk is full")

    ledger._write = write  # type: ignore[method-assign]


def _ledger_lines(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "sluice.usage" and r.levelno >= logging.WARNING]


async def test_a_failure_is_logged_when_it_starts_and_when_it_ends(tmp_path, caplog):
    caplog.set_level(logging.INFO, "sluice.usage")
    ledger = SQLiteLedger(tmp_path / "u.sqlite3", flush_interval_s=0.01)
    real = ledger._write
    _failing(ledger)
    ledger.append(_row(0))
    for _ in range(60):  # thirty seconds of flushes at the default interval
        await ledger.flush()
    assert len(_ledger_lines(caplog)) == 1
    assert _ledger_lines(caplog)[0].levelno == logging.ERROR
    ledger._write = real  # type: ignore[method-assign]
    for _ in range(5):
        await ledger.flush()
    lines = _ledger_lines(caplog)
    assert len(lines) == 2 and "admitting metered requests" in lines[1].getMessage()
    await ledger.close()
    assert [r.prompt_tokens for r in read_sqlite(tmp_path / "u.sqlite3", 0)] == [10]


def test_a_long_failure_gets_a_reminder_per_interval(caplog):
    from gateway.admission.outage import Outage

    caplog.set_level(logging.INFO, "sluice.test")
    now = [0.0]
    outage = Outage("thing", logging.getLogger("sluice.test"), remind_every_s=60, clock=lambda: now[0])
    for _ in range(241):  # two minutes, twice a second
        outage.failed("disk full")
        now[0] += 0.5
    outage.recovered()
    levels = [r.levelname for r in caplog.records]
    assert levels == ["ERROR", "WARNING", "WARNING", "WARNING"]  # start, at 60 s, at 120 s, the end
    assert outage.problem is None


async def test_rows_kept_in_memory_are_bounded_and_the_rest_spilled(tmp_path):
    from gateway.admission.spill import Spill

    spill = Spill(tmp_path / "spill" / "u.spill.jsonl")
    ledger = SQLiteLedger(tmp_path / "u.sqlite3", spill=spill, max_pending_rows=100)
    real = ledger._write
    _failing(ledger)
    for i in range(1000):
        ledger.append(_row(i))
    await ledger.flush()
    assert ledger.pending == 100
    assert sum(len(b.records) for b in spill.batches()) == 900
    assert ledger.problem is not None
    ledger._write = real  # type: ignore[method-assign]
    await ledger.flush()
    assert ledger.problem is None and not spill.path.exists()
    await ledger.close()
    assert sorted(r.prompt_tokens for r in read_sqlite(tmp_path / "u.sqlite3", 0)) == [10 + i for i in range(1000)]


async def test_the_ballast_makes_room_on_a_full_disk(tmp_path):
    with tmpfs(tmp_path / "disk", size="1m"):
        path = tmp_path / "disk" / "u.sqlite3"
        ledger = SQLiteLedger(path, ballast_bytes=256 * 1024)
        await ledger.open()
        assert ledger.ballast.stat().st_size == 256 * 1024 and ledger.problem is None
        fill(tmp_path / "disk" / "fill")
        for i in range(50):
            ledger.append(_row(i))
        assert await ledger.flush() == 50  # written into the ballast's room
        assert not ledger.ballast.exists()
        assert ledger.problem is not None  # refusing until the reserve is back
        assert len(list(read_sqlite(path, 0))) == 50
        (tmp_path / "disk" / "fill").unlink()
        await ledger.flush()
        assert ledger.problem is None and ledger.ballast.exists()
        await ledger.close()


async def test_a_spilled_batch_taken_in_is_never_counted_twice(tmp_path):
    """A crash after the rows were written and before the spill file was cleared: the batch id in the
    ledger keeps the next start from taking them in (or counting them) again."""
    from gateway.admission.spill import Spill

    spill = Spill(tmp_path / "u.spill.jsonl")
    spill.append([asdict(_row(i)) for i in range(3)])
    ledger = SQLiteLedger(tmp_path / "u.sqlite3", spill=spill)
    await ledger._import(spill.batches())  # taken in; the file not yet cleared
    await ledger.close()
    assert len(spill.batches()) == 1

    again = SQLiteLedger(tmp_path / "u.sqlite3", spill=spill)
    store = UsageStore()
    store.restore(await again.totals_by_key() or {})
    assert (await store.totals("frank"))["totals"]["requests"] == 3
    await again.open()
    assert not spill.path.exists()
    await again.close()
    assert len(list(read_sqlite(tmp_path / "u.sqlite3", 0))) == 3


async def test_rows_nobody_can_keep_are_reported_with_each_keys_spend(tmp_path, caplog):
    from gateway.admission.spill import Spill

    caplog.set_level(logging.INFO, "sluice.usage")
    (tmp_path / "not-a-dir").write_text("")
    ledger = SQLiteLedger(tmp_path / "u.sqlite3", spill=Spill(tmp_path / "not-a-dir" / "u.spill.jsonl"))
    _failing(ledger)
    ledger.append(_row(0, "frank", 0.25))
    ledger.append(_row(1, "frank", 0.5))
    ledger.append(_row(2, None, 0.125))
    await ledger.close()
    lost = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR and "LOST" in r.getMessage()]
    assert len(lost) == 1
    assert "3 rows LOST" in lost[0] and "frank: 2 requests, cost 0.750000" in lost[0]
    assert "(anonymous): 1 requests, cost 0.125000" in lost[0]


async def test_the_ledger_and_its_files_are_private(tmp_path):
    old = os.umask(0o022)
    try:
        ledger = SQLiteLedger(tmp_path / "usage.sqlite3")
        ledger.append(_row(0))
        await ledger.flush()
        for name in ("usage.sqlite3", "usage.sqlite3-wal", "usage.sqlite3-shm"):
            assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o600, name
        await ledger.close()
    finally:
        os.umask(old)


async def test_the_ballast_and_the_spill_are_private(tmp_path):
    from gateway.admission.spill import Spill

    old = os.umask(0o022)
    try:
        spill = Spill(tmp_path / "spill.jsonl")
        ledger = SQLiteLedger(tmp_path / "usage.sqlite3", spill=spill, ballast_bytes=4096)
        await ledger.open()
        spill.append([asdict(_row(1))])
        for name in ("usage.sqlite3.ballast", "spill.jsonl"):
            assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o600, name
        await ledger.close()
    finally:
        os.umask(old)


async def test_an_existing_world_readable_ledger_is_made_private(tmp_path):
    path = tmp_path / "usage.sqlite3"
    sqlite3.connect(path).close()
    os.chmod(path, 0o644)
    ledger = SQLiteLedger(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    await ledger.close()


async def test_a_refused_request_ends_the_outage_once_writes_succeed(tmp_path):
    """Admission tries the storage itself while failing (not only the next flush), so the first request
    after it is back is admitted."""
    ledger = SQLiteLedger(tmp_path / "u.sqlite3", flush_interval_s=3600)
    ledger._recovery.clock = clock = Clock()
    real = ledger._write
    _failing(ledger)
    ledger.append(_row(0))
    await ledger.flush()
    assert not await ledger.recover_now()
    ledger._write = real  # type: ignore[method-assign]
    assert not await ledger.recover_now()  # within the attempts' rate limit: not tried again yet
    clock.t += ledger._recovery.every_s  # past it
    assert await ledger.recover_now() and ledger.problem is None
    await ledger.close()
    assert len(list(read_sqlite(tmp_path / "u.sqlite3", 0))) == 1


async def test_refused_requests_share_one_recovery_attempt():
    from gateway.admission.outage import Recovery

    calls = []

    async def attempt() -> bool:
        calls.append(1)
        await asyncio.sleep(0.05)
        return True

    clock = Clock()
    recovery = Recovery(attempt, every_s=10, clock=clock)
    assert await asyncio.gather(*(recovery() for _ in range(20))) == [True] * 20
    assert len(calls) == 1
    clock.t += 9.9
    assert await recovery() is False and len(calls) == 1  # at most one attempt per every_s
    clock.t += 0.1
    assert await recovery() is True and len(calls) == 2
