"""A full disk under the usage ledger, end to end: a real `sluice serve` with its ledger on a 1 MB tmpfs that
is filled up while it serves. Nothing accepted may vanish: every answered request is in `/v1/usage` after a
SIGTERM and a restart, a spent budget still refuses, and while spend cannot be written metered requests
get 503 `usage_unavailable` (logged once, not per request or per flush)."""

from __future__ import annotations

import contextlib
import csv
import errno
import io
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.fixtures.processes import (
    CHAT,
    PRICE_IN,
    PRICE_OUT,
    Gateway,
    create_key,
    env_for,
    start_mock,
    stop_all,
    write_config,
)
from tests.fixtures.servers import ROOT, free_port

pytestmark = pytest.mark.slow

COST = (2 * PRICE_IN + 6 * PRICE_OUT) / 1e6  # "hello there" is 2 words; the mock answers 6


@contextlib.contextmanager
def tmpfs(path: Path, size: str = "1m"):
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True,
                       text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN): {r.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def fill(path: Path) -> None:
    """Write zeros to `path` until the filesystem is full."""
    with open(path, "wb", buffering=0) as f:
        block = b"\0" * 4096
        while True:
            try:
                f.write(block)
            except OSError as e:
                assert e.errno == errno.ENOSPC
                return


def usage_of(gw: Gateway, key: str) -> dict:
    st, body = gw.call("/v1/usage", key)
    assert st == 200, body
    return body["totals"]


@pytest.mark.parametrize("ballast_mb", [0.25, 0.0], ids=["ballast", "no-ballast"])
def test_full_disk_keeps_every_request_and_the_budget_across_a_restart(tmp_path, ballast_mb):
    disk = tmp_path / "disk"
    spill_dir = tmp_path / "spill"  # another filesystem than the ledger's
    with tmpfs(disk):
        mock, mport = start_mock(tmp_path)
        procs = [mock]
        port = free_port()
        cfg = write_config(tmp_path / "sluice.toml", port=port, mock_port=mport, tmp_path=tmp_path, extra=f"""
[usage]
ledger_path = "{disk / 'usage.sqlite3'}"
flush_interval_s = 2.0
ballast_mb = {ballast_mb}
spill_dir = "{spill_dir}"
[limits.keys.gina]
budget = {COST / 2}
""")
        frank, gina = create_key(cfg, "frank"), create_key(cfg, "gina")
        try:
            gw = Gateway(cfg, tmp_path / "gw1.log", port)
            procs.append(gw.proc)
            fill(disk / "fill")
            served = {"frank": 0, "gina": 0}

            st, body = gw.call("/v1/chat/completions", gina, CHAT)  # nothing pending yet: always admitted
            assert st == 200, body
            served["gina"] += 1
            st, body = gw.call("/v1/chat/completions", gina, CHAT)
            assert (st, body["error"]["code"]) in ((429, "insufficient_quota"), (503, "usage_unavailable")), body

            refused, deadline = 0, time.time() + 20  # until well after the first failed flush
            while refused < 20 and time.time() < deadline:
                st, body = gw.call("/v1/chat/completions", frank, CHAT)
                if st == 200:
                    served["frank"] += 1
                else:
                    assert st == 503 and body["error"]["code"] == "usage_unavailable", body
                    refused += 1
            assert served["frank"] > 0  # answered while the disk was full, before the first flush failed (<= 2 s)
            assert gw.stop() == 0
            log1 = gw.text()

            # The disk is still full: every answered request is counted, and metered requests are refused.
            gw = Gateway(cfg, tmp_path / "gw2.log", port)
            procs.append(gw.proc)
            assert usage_of(gw, frank)["requests"] == served["frank"]
            assert usage_of(gw, gina)["requests"] == served["gina"]
            assert usage_of(gw, frank)["cost"] == pytest.approx(served["frank"] * COST)
            assert refused == 20  # refused (fail closed) once a write had failed
            assert log1.count("refusing metered requests") == 1, log1[-3000:]  # once, not per request or flush
            assert "LOST" not in log1
            if ballast_mb:
                assert "released its reserve file" in log1
            else:
                spill = spill_dir / "usage.sqlite3.spill.jsonl"
                assert spill.exists() and stat.S_IMODE(spill.stat().st_mode) == 0o600
            st, body = gw.call("/v1/chat/completions", frank, CHAT)
            refused_after_restart = not (ballast_mb and st == 200)
            if not refused_after_restart:
                # The stopped gateway's clean close (its WAL checkpointed away) freed room for a new reserve
                # file: the restarted one admits only with that reserve back in place.
                served["frank"] += 1
                assert (disk / "usage.sqlite3.ballast").stat().st_size >= ballast_mb * 1e6
            else:
                assert st == 503 and body["error"]["code"] == "usage_unavailable", body

            # Room again: admitted again by itself, and gina's spent budget still refuses.
            (disk / "fill").unlink()
            deadline = time.time() + 20
            while True:
                st, body = gw.call("/v1/chat/completions", gina, CHAT)
                if st != 503 or time.time() > deadline:
                    break
                time.sleep(0.2)
            assert st == 429 and body["error"]["code"] == "insufficient_quota", body
            st, body = gw.call("/v1/chat/completions", frank, CHAT)
            assert st == 200, body
            served["frank"] += 1
            assert gw.stop() == 0
            if refused_after_restart:
                assert "admitting metered requests" in gw.text()

            gw = Gateway(cfg, tmp_path / "gw3.log", port)  # no row counted twice
            procs.append(gw.proc)
            assert usage_of(gw, frank)["requests"] == served["frank"]
            assert usage_of(gw, gina)["requests"] == served["gina"]
            assert gw.stop() == 0
            out = subprocess.run([sys.executable, "-m", "gateway.cli", "usage", "--since", "1h", "--csv", "--ledger",
                                  str(disk / "usage.sqlite3")], cwd=ROOT, env=env_for(cfg), capture_output=True,
                                 text=True, check=True).stdout
            assert {r["key"]: int(r["requests"]) for r in csv.DictReader(io.StringIO(out))} == served
            for name in ("usage.sqlite3", "usage.sqlite3-wal"):
                p = disk / name
                if p.exists():
                    assert stat.S_IMODE(p.stat().st_mode) == 0o600, name
        finally:
            stop_all(procs)


def test_a_ledger_that_cannot_be_created_is_one_line_and_a_nonzero_exit(tmp_path):
    disk = tmp_path / "disk"
    with tmpfs(disk, size="64k"):
        fill(disk / "fill")
        mock, mport = start_mock(tmp_path)
        try:
            cfg = write_config(tmp_path / "sluice.toml", port=free_port(), mock_port=mport, tmp_path=tmp_path,
                               extra=f'[usage]\nledger_path = "{disk / "usage.sqlite3"}"\n')
            r = subprocess.run([sys.executable, "-m", "gateway.cli", "serve"], cwd=ROOT, env=env_for(cfg),
                               capture_output=True, text=True, timeout=120)
        finally:
            stop_all([mock])
    assert r.returncode != 0
    assert "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if "usage ledger" in ln]
    assert len(lines) == 1 and "refusing to start" in lines[0], r.stderr
