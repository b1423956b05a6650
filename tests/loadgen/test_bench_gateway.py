"""`sluice bench` against a Sluice gateway (fake engine, the mock provider as remote `a`): the backend
split comes from the gateway's own `x-sluice-backend` headers, and the gateway's `GET /v1/usage`
before/after delta agrees with the bench's own count and price table."""

from __future__ import annotations

import io
import json
import os

import pytest
from rich.console import Console

from loadgen.cli import amain
from tests.fixtures.mock_provider import MockProvider
from tests.fixtures.providers import LOCAL_MODEL, REMOTE_MODEL, gateway, provider_cfg


async def test_bench_through_sluice_splits_by_backend_and_matches_v1_usage(tmp_path):
    os.environ["SLUICE_TEST_A_KEY"] = "sk-upstream-a"
    a = await MockProvider("a", tokens=5).start()
    data = tmp_path / "mixed.jsonl"
    lines = [{"model": model, "messages": [{"role": "user", "content": f"question {i} about rivers"}],
              "max_tokens": 4} for i, model in enumerate([LOCAL_MODEL, REMOTE_MODEL, REMOTE_MODEL])]
    data.write_text("\n".join(json.dumps(x) for x in lines))
    out = tmp_path / "gw.json"
    try:
        async with gateway(tmp_path, [provider_cfg(a)], keys={"p": "pro", "s": "standard"}) as (base, _, _, keys):
            rc = await amain(["--no-progress", "--warmup", "0", "--base-url", base, "--dataset", str(data),
                              "--concurrency", "3", "--requests", "12", "--tier-mix", "pro=1,standard=1",
                              "--key", f"pro={keys['p']}", "--key", f"standard={keys['s']}",
                              "--price-backend", "remote:a=1:2", "--price-backend", "local=0:0", "--json", str(out)],
                             console=Console(file=io.StringIO(), width=250),
                             err_console=Console(file=io.StringIO(), width=250))
    finally:
        await a.stop()
    assert rc == 0
    level = json.loads(out.read_text())["levels"][0]
    s, raw, gw = level["summary"], level["requests"], level["gateway_usage"]
    assert s["requests"] == s["ok"] == 12
    assert {b: g["requests"] for b, g in s["by_backend"].items()} == {"local": 4, "remote:a": 8}
    assert all(r["backend"] == ("local" if r["model"] == LOCAL_MODEL else "remote:a") for r in raw)
    assert a.count == 8  # the provider saw exactly the remote ones

    # the gateway's own accounting of the level
    assert gw["totals"]["requests"] == 12
    assert gw["totals"]["completion_tokens"] == s["output_tokens"] == sum(r["output_tokens"] for r in raw)
    assert gw["totals"]["prompt_tokens"] == sum(r["prompt_tokens"] for r in raw)
    assert {b: v["requests"] for b, v in gw["by_backend"].items()} == {"local": 4, "remote:a": 8}
    assert gw["totals"]["cost"] == pytest.approx(s["cost"]["total"])  # provider a: $1 / $2 per M, as priced
    assert set(gw["by_key"]) == {"pro", "standard"}
    assert sum(v["requests"] for v in gw["by_key"].values()) == 12
