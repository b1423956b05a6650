"""The real gateway (`sluice serve`, real engine and model) with a mock provider over real HTTP: a
remote-only model is relayed (JSON and streamed, through the OpenAI SDK), the local model stays
local, and usage, cost and metrics add up."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.fixtures.servers import ROOT, free_port, wait_http_ok

pytestmark = [pytest.mark.slow, pytest.mark.model]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("remote-real")
    mport, gport = free_port(), free_port()
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": str(ROOT)}
    mlog = tmp / "mock.log"
    mock = subprocess.Popen([sys.executable, "-m", "tests.fixtures.mock_provider", "--port", str(mport),
                             "--tokens", "6", "--itl-ms", "5"], cwd=ROOT, env=env, stdout=open(mlog, "w"),
                            stderr=subprocess.STDOUT)
    cfg = tmp / "sluice.toml"
    cfg.write_text(f"""
[server]
port = {gport}
[engine]
kv_cache_tokens = 4096
wide_min_rows = 0
[auth]
keys_file = "{tmp / 'keys.json'}"
[tiers.pro]
priority = 0
max_queue_wait_ms = 10000
[tiers.standard]
priority = 1
max_queue_wait_ms = 2000
[[providers]]
name = "mock"
base_url = "http://127.0.0.1:{mport}/v1"
api_key_env = "SLUICE_TEST_MOCK_KEY"
models = {{ "remote-model" = "upstream-model" }}
input_price_per_m = 0.5
output_price_per_m = 1.5
""")
    env = {**env, "SLUICE_CONFIG": str(cfg), "SLUICE_TEST_MOCK_KEY": "sk-upstream-secret"}
    key = subprocess.run([sys.executable, "-m", "gateway.cli", "keys", "create", "--name", "t", "--tier", "pro"],
                         cwd=ROOT, env=env, capture_output=True, text=True, check=True).stdout.strip()
    admin = subprocess.run([sys.executable, "-m", "gateway.cli", "keys", "create", "--name", "ops", "--admin"],
                           cwd=ROOT, env=env, capture_output=True, text=True, check=True).stdout.strip()
    glog = tmp / "gateway.log"
    gw = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve"], cwd=ROOT, env=env,
                          stdout=open(glog, "w"), stderr=subprocess.STDOUT)
    try:
        wait_http_ok(f"http://127.0.0.1:{gport}/ready", gw, glog)
        yield f"http://127.0.0.1:{gport}", key, glog, admin
    finally:
        for p in (gw, mock):
            p.terminate()
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()


def test_real_gateway_routes_counts_and_never_logs_secrets(stack):
    from openai import OpenAI

    base, key, glog, admin = stack
    client = OpenAI(base_url=base + "/v1", api_key=key, max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model="remote-model", messages=[{"role": "user", "content": "one two three"}])
    assert raw.headers["x-sluice-backend"] == "remote:mock"
    r = raw.parse()
    assert r.model == "remote-model" and r.choices[0].message.content == "w0 w1 w2 w3 w4 w5"
    usages = [r.usage]

    with client.chat.completions.with_streaming_response.create(
            model="remote-model", messages=[{"role": "user", "content": "four five"}], stream=True,
            stream_options={"include_usage": True}) as resp:
        assert resp.headers["x-sluice-backend"] == "remote:mock"
        chunks = list(resp.parse())
    assert "".join((c.choices[0].delta.content or "") for c in chunks if c.choices) == "w0 w1 w2 w3 w4 w5"
    usages.append(chunks[-1].usage)

    models = client.models.list()  # the local model is still listed, next to the provider's
    local_model = models.data[0].id
    raw = client.chat.completions.with_raw_response.create(
        model=local_model, messages=[{"role": "user", "content": "Say hi."}], max_tokens=4, temperature=0)
    assert raw.headers["x-sluice-backend"] == "local"
    usages.append(raw.parse().usage)

    with urllib.request.urlopen(urllib.request.Request(base + "/v1/usage",
                                                       headers={"Authorization": f"Bearer {key}"})) as u:
        usage = json.loads(u.read())
    t = usage["totals"]
    assert t["requests"] == 3
    assert t["prompt_tokens"] == sum(u.prompt_tokens for u in usages)
    assert t["completion_tokens"] == sum(u.completion_tokens for u in usages)
    remote = usage["by_backend"]["remote:mock"]
    assert remote["cost"] == pytest.approx((remote["prompt_tokens"] * 0.5 + remote["completion_tokens"] * 1.5) / 1e6)

    time.sleep(2.2)  # the sampler refreshes engine and queue gauges every second
    with urllib.request.urlopen(urllib.request.Request(base + "/metrics",  # needs an admin key
                                                       headers={"Authorization": f"Bearer {admin}"})) as m:
        metrics = m.read().decode()
    busy = [line for line in metrics.splitlines() if line.startswith("sluice_engine_busy_seconds ")]
    assert busy and float(busy[0].split()[1]) > 0
    assert "sluice_engine_busy_ratio" in metrics
    assert 'sluice_ttft_seconds_count{backend="remote:mock",tier="pro"} 2.0' in metrics
    assert 'sluice_route_decisions_total{backend="local",reason="local",tier="pro"}' not in metrics  # local-only model
    log = glog.read_text()
    assert "sk-upstream-secret" not in log and key not in log and admin not in log
