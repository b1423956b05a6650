"""Redis unreachable under the usage store and its ledger stream, end to end: a real `sluice serve` with
`limits.redis_url` on its own redis-server, which dies while requests are in flight. Their usage cannot
reach Redis: it is kept (the spill file at shutdown) and taken in at the next start, so `/v1/usage` and the
ledger stream count every answered request; meanwhile metered requests get 503 `usage_unavailable`, the
outage is logged once (not per request), and the holds the dead gateway could not settle are released."""

from __future__ import annotations

import concurrent.futures
import time

import pytest

from gateway.admission.ledger import read_redis
from tests.fixtures.processes import Gateway, create_key, start_mock, stop_all, write_config
from tests.fixtures.servers import RedisServer, _have_redis_server, free_port

pytestmark = pytest.mark.slow

BODY = {"model": "remote-model", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 64}
# Each request costs 0.014 and holds about 0.3 while it runs (its size in bytes at the input price, 64 tokens
# at the output price): two in flight fit, but two holds left behind would leave no room afterwards.
BUDGET = 0.4


def test_redis_outage_loses_no_usage_and_fails_closed(tmp_path):
    if not _have_redis_server():
        pytest.skip("redis-server is not installed (make test installs it: apt-get install redis-server)")
    redis = RedisServer(tmp_path / "redis")
    redis.start()
    mock, mport = start_mock(tmp_path, tokens=6, ttft_ms=1500)  # long enough to kill Redis mid-request
    procs = [mock]
    port = free_port()
    cfg = write_config(tmp_path / "sluice.toml", port=port, mock_port=mport, tmp_path=tmp_path, extra=f"""
[limits]
redis_url = "{redis.url}"
[limits.keys.rita]
budget = {BUDGET}
""")
    key = create_key(cfg, "rita")
    pool = concurrent.futures.ThreadPoolExecutor(4)
    try:
        gw = Gateway(cfg, tmp_path / "gw1.log", port)
        procs.append(gw.proc)
        served = 0
        for _ in range(2):
            st, body = gw.call("/v1/chat/completions", key, BODY)
            assert st == 200, body
            served += 1
        in_flight = [pool.submit(gw.call, "/v1/chat/completions", key, BODY) for _ in range(2)]
        time.sleep(0.7)  # admitted (their holds taken), the provider not yet answered
        redis.stop(kill=True)
        for f in in_flight:
            st, body = f.result()
            assert st == 200, body  # answered: now their usage must not vanish
            served += 1
        time.sleep(1.5)  # a flush of the ledger, a retry of the totals
        during = [gw.call("/v1/chat/completions", key, BODY) for _ in range(20)]
        served += sum(st == 200 for st, _ in during)
        assert gw.stop() == 0
        log1 = gw.text()

        redis.start()  # the same data (AOF)
        gw = Gateway(cfg, tmp_path / "gw2.log", port)
        procs.append(gw.proc)
        st, usage = gw.call("/v1/usage", key)
        assert st == 200 and usage["totals"]["requests"] == served, usage
        rows = [r for r in read_redis(redis.url, 0) if r.key == "rita"]
        assert len(rows) == served
        for st, body in during:  # refused while spend could not be recorded
            assert st == 503 and body["error"]["code"] == "usage_unavailable", body
        assert log1.count("refusing metered requests") <= 2, log1[-3000:]  # the ledger and the totals: once each
        usage_lines = [ln for ln in log1.splitlines() if " sluice.usage: " in ln]
        assert len(usage_lines) <= 4, "\n".join(usage_lines)  # + one "saved to the spill" each: not per request
        assert "LOST" not in log1
        # The dead gateway's holds were released with its spilled totals: the budget is not held by them.
        st, body = gw.call("/v1/chat/completions", key, BODY)
        assert st == 200, body
        assert gw.stop() == 0
    finally:
        pool.shutdown(wait=False)
        stop_all(procs)
        redis.stop()
