"""The usage ledger across a crash, end to end: a real `sluice serve` (remote-only model on the mock provider,
no local model loaded), kill -9 after N requests, restart: /v1/usage and the key's remaining budget are exactly
what they were before the kill."""

from __future__ import annotations

import csv
import io
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from tests.fixtures.processes import stop_all
from tests.fixtures.servers import ROOT, free_port, wait_http_ok

pytestmark = pytest.mark.slow

FLUSH_S = 0.5
PRICE_IN, PRICE_OUT = 1000.0, 2000.0  # per million: one request (2 prompt words, 6 tokens) costs 0.014
COST = (2 * PRICE_IN + 6 * PRICE_OUT) / 1e6
BUDGET = 0.1  # refused once spent >= 0.1: after 8 requests (7 * 0.014 = 0.098)


def _call(url: str, key: str, body: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode() if body is not None else None,
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_kill_9_restart_keeps_usage_and_budget(tmp_path):
    mport, gport = free_port(), free_port()
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": str(ROOT)}
    env.pop("SLUICE_REDIS_URL", None)
    mock = subprocess.Popen([sys.executable, "-m", "tests.fixtures.mock_provider", "--port", str(mport),
                             "--tokens", "6"], cwd=ROOT, env=env, stdout=open(tmp_path / "mock.log", "w"),
                            stderr=subprocess.STDOUT)
    cfg = tmp_path / "sluice.toml"
    cfg.write_text(f"""
[server]
port = {gport}
[model]
path = "{tmp_path / 'no-local-model'}"
[auth]
keys_file = "{tmp_path / 'keys.json'}"
[usage]
flush_interval_s = {FLUSH_S}
[[providers]]
name = "mock"
base_url = "http://127.0.0.1:{mport}/v1"
models = {{ "remote-model" = "upstream-model" }}
input_price_per_m = {PRICE_IN}
output_price_per_m = {PRICE_OUT}
[limits.keys.team-a]
budget = {BUDGET}
""")
    env["SLUICE_CONFIG"] = str(cfg)
    key = subprocess.run([sys.executable, "-m", "gateway.cli", "keys", "create", "--name", "team-a", "--tier", "pro"],
                         cwd=ROOT, env=env, capture_output=True, text=True, check=True).stdout.strip()
    base = f"http://127.0.0.1:{gport}"
    chat = {"model": "remote-model", "messages": [{"role": "user", "content": "hello there"}]}
    procs: list[subprocess.Popen] = [mock]

    def serve(n: int) -> subprocess.Popen:
        log = tmp_path / f"gateway{n}.log"
        gw = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve"], cwd=ROOT, env=env,
                              stdout=open(log, "w"), stderr=subprocess.STDOUT)
        procs.append(gw)
        wait_http_ok(base + "/health", gw, log, timeout=120)
        return gw

    try:
        gw = serve(1)
        for _ in range(5):
            st, body = _call(base + "/v1/chat/completions", key, chat)
            assert st == 200, body
        st, before = _call(base + "/v1/usage", key)
        assert st == 200 and before["totals"]["requests"] == 5
        assert before["totals"]["cost"] == pytest.approx(5 * COST)
        time.sleep(FLUSH_S * 3)  # the rows reach the ledger within one flush interval
        gw.send_signal(signal.SIGKILL)
        gw.wait(10)

        serve(2)
        st, after = _call(base + "/v1/usage", key)
        assert st == 200 and after == before  # totals, by model and by backend: exactly

        # The remaining budget is the same: the 8th request is the last one served, as without a restart.
        served = 5
        while True:
            st, body = _call(base + "/v1/chat/completions", key, chat)
            if st != 200:
                break
            served += 1
            assert served < 20
        assert st == 429 and body["error"]["code"] == "insufficient_quota"
        assert served == 8
        st, final = _call(base + "/v1/usage", key)
        assert final["totals"]["requests"] == 8 and final["totals"]["cost"] == pytest.approx(8 * COST)
        time.sleep(FLUSH_S * 3)

        out = subprocess.run([sys.executable, "-m", "gateway.cli", "usage", "--since", "1h", "--csv"], cwd=ROOT,
                             env=env, capture_output=True, text=True, check=True).stdout
        rows = list(csv.DictReader(io.StringIO(out)))
        assert len(rows) == 1 and rows[0]["key"] == "team-a" and rows[0]["requests"] == "8"
        assert float(rows[0]["spend"]) == pytest.approx(8 * COST, abs=1e-6)
        assert float(rows[0]["savings"]) == 0.0  # remote answers: spend is the equivalent
    finally:
        stop_all(procs)
