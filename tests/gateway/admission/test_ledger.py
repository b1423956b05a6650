"""The usage ledger (gateway/admission/ledger.py): batching off the request path, retention, rebuilding the usage
store's totals after a restart, savings, the Redis stream, and `sluice usage`."""

from __future__ import annotations

import asyncio
import csv
import dataclasses
import io
import sqlite3
import time

import pytest

from gateway.admission.ledger import (
    RedisLedger,
    SQLiteLedger,
    UsageRow,
    group_report,
    read_redis,
    read_sqlite,
)
from gateway.admission.usage import UsageStore
from gateway.cli import main as cli_main
from gateway.cli import parse_since
from gateway.routing.accounting import Accountant
from gateway.settings import ProviderSettings


def _row(i: int, *, ts: float | None = None, key: str = "team-a", model: str = "smol", backend: str = "local",
         tier: str = "pro", cost: float | None = None, equivalent: float | None = None) -> UsageRow:
    c = (i % 7) * 1e-5 + 1e-7 if cost is None else cost
    return UsageRow(time.time() if ts is None else ts, key, tier, model, backend, 10 + i, i % 3, 5 + i % 4, c,
                    c * 3 if equivalent is None else equivalent)


def _count(path) -> int:
    with sqlite3.connect(path) as db:
        return db.execute("SELECT count(*) FROM usage").fetchone()[0]


async def test_rows_are_batched_and_flushed_off_the_request_path(tmp_path):
    path = tmp_path / "usage.sqlite3"
    ledger = SQLiteLedger(path, flush_interval_s=0.05)
    for i in range(20):
        ledger.append(_row(i))
    assert ledger.pending == 20 and _count(path) == 0  # append does no I/O
    ledger.start()
    for _ in range(250):  # the flush thread commits the rows, then takes them off `pending`
        if _count(path) == 20 and ledger.pending == 0:
            break
        await asyncio.sleep(0.02)
    assert _count(path) == 20 and ledger.pending == 0
    ledger.append(_row(20))
    await ledger.close()  # the last batch is written on shutdown
    assert _count(path) == 21
    assert [r.prompt_tokens for r in read_sqlite(path, 0)] == [10 + i for i in range(21)]
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


async def test_a_failed_write_keeps_the_rows_for_the_next_flush(tmp_path):
    ledger = SQLiteLedger(tmp_path / "u.sqlite3")
    calls = []

    async def failing(rows):
        calls.append(len(rows))
        raise OSError("disk full")

    real = ledger._write
    ledger._write = failing  # type: ignore[method-assign]
    ledger.append(_row(1))
    assert await ledger.flush() == 0 and ledger.pending == 1
    ledger._write = real  # type: ignore[method-assign]
    ledger.append(_row(2))
    assert await ledger.flush() == 2
    await ledger.close()
    assert [r.prompt_tokens for r in read_sqlite(tmp_path / "u.sqlite3", 0)] == [11, 12]


async def test_close_ends_a_flush_that_absorbs_its_cancellation(tmp_path):
    """redis-py can turn a cancellation that lands mid-command into a ConnectionError: close() must
    still end the flush loop (it cancels until the task ends), then write the rows kept."""
    ledger = SQLiteLedger(tmp_path / "u.sqlite3", flush_interval_s=0.01)
    real, absorbed = ledger._write, []

    async def absorbing(rows):
        if not absorbed:
            try:
                await asyncio.sleep(30)  # a write stuck on a restarting Redis
            except asyncio.CancelledError:
                absorbed.append(True)
                raise ConnectionError("Connection closed by server.") from None
        await real(rows)

    ledger._write = absorbing  # type: ignore[method-assign]
    ledger.start()
    ledger.append(_row(1))
    await asyncio.sleep(0.1)  # the loop is inside the stuck write
    await asyncio.wait_for(ledger.close(), timeout=5)
    assert absorbed == [True]
    assert [r.prompt_tokens for r in read_sqlite(tmp_path / "u.sqlite3", 0)] == [11]


async def test_restart_rebuilds_the_totals_bit_for_bit(tmp_path):
    path = tmp_path / "usage.sqlite3"
    store, ledger = UsageStore(), SQLiteLedger(path)
    for i in range(300):
        r = _row(i, key=("a", "b", "c")[i % 3], model=("m1", "m2")[i % 2], backend=("local", "remote:x")[i % 5 == 0])
        ledger.append(r)
        await store.record(r.key, r.model, r.backend, r.prompt_tokens, r.cached_tokens, r.completion_tokens, r.cost)
    await ledger.close()

    again = SQLiteLedger(path)
    fresh = UsageStore()
    fresh.restore(await again.totals_by_key() or {})
    for key in ("a", "b", "c", "nobody"):
        assert await fresh.totals(key) == await store.totals(key)
        assert await fresh.spent(key) == await store.spent(key)  # the same float: a budget refuses alike
    await again.close()


async def test_retention_deletes_old_rows_but_keeps_their_sums(tmp_path):
    path = tmp_path / "usage.sqlite3"
    store, ledger = UsageStore(), SQLiteLedger(path, retention_days=30)
    now = time.time()
    for i in range(10):
        r = _row(i, ts=now - (40 if i < 6 else 1) * 86400)
        ledger.append(r)
        await store.record(r.key, r.model, r.backend, r.prompt_tokens, r.cached_tokens, r.completion_tokens, r.cost)
    await ledger.flush()  # the first flush also applies retention
    assert _count(path) == 4
    assert len(list(read_sqlite(path, 0))) == 4
    fresh = UsageStore()
    fresh.restore(await ledger.totals_by_key() or {})
    want, got = await store.totals("team-a"), await fresh.totals("team-a")
    assert got["totals"]["requests"] == 10
    assert got["totals"]["prompt_tokens"] == want["totals"]["prompt_tokens"]
    assert got["totals"]["cost"] == pytest.approx(want["totals"]["cost"], abs=1e-12)
    assert ledger.prune_sync(now - 20 * 86400) == 0  # idempotent
    await ledger.close()


def test_savings_to_the_cent_on_replayed_rows():
    """1000 local requests of a model a provider sells at 0.15 / 0.60 (cached 0.075) per million, local
    tokens priced at 0.02 / 0.05; 200 remote ones (no savings); 50 of a model no provider serves."""
    provider = ProviderSettings(name="p", base_url="https://p.example/v1", models={"smol": "gpt-4o-mini"},
                                input_price_per_m=0.15, output_price_per_m=0.60, cached_input_price_per_m=0.075,
                                order=1)
    dearer = ProviderSettings(name="q", base_url="https://q.example/v1", models={"smol": "x"},
                              input_price_per_m=9.0, output_price_per_m=9.0, order=2)
    acc = Accountant(None, UsageStore(), None, None, {"input_per_m": 0.02, "output_per_m": 0.05},  # type: ignore[arg-type]
                     providers=[dearer, provider])
    rows = []
    for _ in range(1000):  # prompt 2000 (500 cached), completion 400
        rows.append(UsageRow(0, "k", "pro", "smol", "local", 2000, 500, 400, *acc.costs("smol", None, 2000, 500, 400)))
    for _ in range(200):
        rows.append(UsageRow(0, "k", "pro", "smol", "remote:p", 1000, 0, 100,
                             *acc.costs("smol", provider, 1000, 0, 100)))
    for _ in range(50):
        rows.append(UsageRow(0, "k", "pro", "other", "local", 1000, 0, 1000, *acc.costs("other", None, 1000, 0, 1000)))
    by_backend = {g["backend"]: g for g in group_report(rows, "backend")}
    # local: spend 1000 * (2000*0.02 + 400*0.05)/1e6 = 0.06; + other 50 * (0.02 + 0.05)/1e3 = 0.0035
    # equivalent 1000 * (1500*0.15 + 500*0.075 + 400*0.60)/1e6 = 0.5025; other: = its cost, 0.0035
    assert round(by_backend["local"]["spend"], 4) == 0.0635
    assert round(by_backend["local"]["equivalent"], 4) == 0.5060
    assert round(by_backend["local"]["savings"], 2) == 0.44
    assert by_backend["local"]["savings"] == pytest.approx(0.4425, abs=1e-9)
    # remote: 200 * (1000*0.15 + 100*0.60)/1e6 = 0.042 spent, nothing saved
    assert by_backend["remote:p"]["spend"] == pytest.approx(0.042, abs=1e-12)
    assert by_backend["remote:p"]["savings"] == pytest.approx(0.0, abs=1e-12)
    by_model = {g["model"]: g for g in group_report(rows, "model")}
    assert by_model["other"]["savings"] == 0.0 and by_model["other"]["requests"] == 50


def test_parse_since_reads_hours_minutes_and_all():
    assert parse_since("24h", now=100_000) == 100_000 - 86400
    assert parse_since("30m", now=10_000) == 10_000 - 1800
    assert parse_since("all") == 0
    with pytest.raises(ValueError):
        parse_since("yesterday")


async def _ledger_file(tmp_path):
    path = tmp_path / "usage.sqlite3"
    ledger = SQLiteLedger(path)
    now = time.time()
    ledger.append(_row(0, ts=now - 3 * 86400, key="old", cost=1.0, equivalent=1.0))  # outside --since 24h
    for i in range(4):
        ledger.append(_row(i, key="team-a", model="smol", cost=0.25, equivalent=1.0))
    for i in range(2):
        ledger.append(_row(i, key="team-b", model="remote-model", backend="remote:mock", tier="standard",
                           cost=0.5, equivalent=0.5))
    await ledger.close()
    return path


async def test_cli_text_and_csv(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("SLUICE_REDIS_URL", raising=False)
    monkeypatch.setenv("SLUICE_CONFIG", str(tmp_path / "none.toml"))
    (tmp_path / "none.toml").write_text("")
    path = await _ledger_file(tmp_path)

    assert cli_main(["usage", "--ledger", str(path), "--csv"]) == 0
    got = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert [g["key"] for g in got] == ["team-a", "team-b"]
    assert got[0] == {"key": "team-a", "requests": "4", "prompt_tokens": str(10 + 11 + 12 + 13),
                      "cached_tokens": str(0 + 1 + 2 + 0), "completion_tokens": str(5 + 6 + 7 + 8),
                      "spend": "1.000000", "equivalent": "4.000000", "savings": "3.000000"}
    assert got[1]["savings"] == "0.000000"

    assert cli_main(["usage", "--ledger", str(path), "--since", "all", "--by", "tier"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["TIER", "REQUESTS", "PROMPT_TOKENS", "CACHED_TOKENS", "COMPLETION_TOKENS", "SPEND",
                                "EQUIVALENT", "SAVINGS"]
    assert lines[1].split() == ["pro", "5", "56", "3", "31", "2.0000", "5.0000", "3.0000"]
    assert lines[2].split() == ["standard", "2", "21", "1", "11", "1.0000", "1.0000", "0.0000"]
    assert lines[3].split() == ["TOTAL", "7", "77", "4", "42", "3.0000", "6.0000", "3.0000"]

    assert cli_main(["usage", "--ledger", str(tmp_path / "missing.sqlite3")]) == 1
    assert cli_main(["usage", "--ledger", str(path), "--since", "soon"]) == 2


async def test_the_batch_flag_is_kept_read_from_ledgers_that_predate_it_and_reported(tmp_path, capsys,
                                                                                      monkeypatch):
    monkeypatch.setenv("SLUICE_CONFIG", str(tmp_path / "none.toml"))
    (tmp_path / "none.toml").write_text("")
    path = tmp_path / "old.sqlite3"
    with sqlite3.connect(path) as db:  # the table as gateways created it before the flag
        db.execute("CREATE TABLE usage (id INTEGER PRIMARY KEY AUTOINCREMENT, ts REAL NOT NULL, key TEXT NOT NULL, "
                   "tier TEXT NOT NULL, model TEXT NOT NULL, backend TEXT NOT NULL, prompt_tokens INTEGER NOT NULL, "
                   "cached_tokens INTEGER NOT NULL, completion_tokens INTEGER NOT NULL, cost REAL NOT NULL, "
                   "equivalent_cost REAL NOT NULL)")
        db.execute("INSERT INTO usage (ts, key, tier, model, backend, prompt_tokens, cached_tokens, "
                   "completion_tokens, cost, equivalent_cost) VALUES (?, 'old', 'pro', 'smol', 'local', 1, 0, 1, "
                   "1.0, 2.0)", (time.time(),))
    assert [r.batch for r in read_sqlite(path, 0)] == [False]  # read as it is, before any gateway migrates it
    ledger = SQLiteLedger(path)
    ledger.append(dataclasses.replace(_row(1, key="new", cost=0.5, equivalent=1.0), batch=True))
    await ledger.close()
    assert [(r.key, r.batch) for r in read_sqlite(path, 0)] == [("old", False), ("new", True)]
    assert cli_main(["usage", "--ledger", str(path), "--by", "batch", "--csv"]) == 0
    got = {g["batch"]: g for g in csv.DictReader(io.StringIO(capsys.readouterr().out))}
    assert (got["online"]["spend"], got["batch"]["spend"]) == ("1.000000", "0.500000")


async def test_redis_stream_ledger(redis_server, tmp_path, capsys):
    ledger = RedisLedger(redis_server.url, retention_days=1, stream="sluice:usage:test")
    now = time.time()
    for i in range(5):
        ledger.append(dataclasses.replace(_row(i, key="team-r", cost=0.1, equivalent=0.3), batch=i == 4))
    await ledger.close()
    rows = list(read_redis(redis_server.url, now - 60, stream="sluice:usage:test"))
    assert [r.prompt_tokens for r in rows] == [10, 11, 12, 13, 14]
    assert rows[0] == _row(0, ts=rows[0].ts, key="team-r", cost=0.1, equivalent=0.3)
    assert [r.batch for r in rows] == [False] * 4 + [True]
    assert list(read_redis(redis_server.url, time.time() + 60, stream="sluice:usage:test")) == []

    # `sluice usage --redis-url` reads the gateway's stream (other tests' gateways may write to it too).
    ledger = RedisLedger(redis_server.url)
    for i in range(3):
        ledger.append(_row(i, key="team-cli", cost=0.25, equivalent=1.0))
    await ledger.close()
    assert cli_main(["usage", "--redis-url", redis_server.url, "--since", "1h", "--csv"]) == 0
    got = {g["key"]: g for g in csv.DictReader(io.StringIO(capsys.readouterr().out))}
    assert got["team-cli"]["requests"] == "3" and got["team-cli"]["savings"] == "2.250000"


async def test_gateway_restart_rebuilds_usage_and_records_savings(tmp_path):
    """In process, on the fake engine: a local model a provider also sells; a graceful stop flushes the
    ledger; the next gateway's /v1/usage is the same, and the rows carry the remote-equivalent cost."""
    import aiohttp

    from tests.fixtures.fake_gateway import fake_gateway
    kw = {"routing": {"local_price": {"input_per_m": 1.0, "output_per_m": 2.0}},
          "providers": [{"name": "p", "base_url": "http://127.0.0.1:9/v1", "models": {"fake-model": "x"},
                         "input_price_per_m": 10.0, "output_price_per_m": 20.0}],
          "usage": {"flush_interval_s": 60.0}}  # only the shutdown flush
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    async with fake_gateway(tmp_path, **kw) as (base, _app, _engine), aiohttp.ClientSession() as s:
        for _ in range(3):
            async with s.post(base + "/v1/chat/completions", json=body) as r:
                assert r.status == 200
        async with s.get(base + "/v1/usage") as r:
            before = await r.json()
    assert before["totals"]["requests"] == 3 and before["totals"]["cost"] > 0
    rows = list(read_sqlite(tmp_path / "usage.sqlite3", 0))
    assert len(rows) == 3 and all(r.backend == "local" and r.key is None for r in rows)
    assert sum(r.equivalent_cost for r in rows) == pytest.approx(10 * sum(r.cost for r in rows))
    async with fake_gateway(tmp_path, **kw) as (base, _app, _engine), aiohttp.ClientSession() as s:
        async with s.get(base + "/v1/usage") as r:
            assert await r.json() == before
