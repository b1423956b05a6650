"""SLO-true admission on the embedded engine (the real model): each tier's p99 time to first token against
its target (`max_queue_wait_ms`, a TTFT target) at 0.5x, 1x, 2x and 3x the engine's capacity, Poisson
arrivals, 30% pro; with a provider (the excess overflows: `bench/mock_engine.py` as a hosted API's scale)
and without one (`routing.refuse_past_target`: the excess is refused early with 429 + Retry-After).

Capacity is measured first: a closed loop of `--concurrency` streams against the same `sluice serve`,
requests finished per second. The goal (issue: engine pools, item 6): each tier's p99 <= target + 20%.

    python -m bench.slo_embedded [--seconds 20] [--pro-target-ms 1500] [--standard-target-ms 3000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from bench.pools import (
    MODEL,
    SLO_TOML,
    Arrival,
    answer_tokens,
    arrivals,
    by_server,
    chat_lengths,
    closed_loop,
    provider_toml,
    replicas,
    run_counted,
    slo_cells,
)
from bench.server import free_port, managed_server
from bench.structured import cpu_model

ROOT = Path(__file__).resolve().parents[1]


async def ttft(s: aiohttp.ClientSession, url: str, prompt: str, tokens: int, key: str,
               backends: list[str] | None = None) -> float:
    """Seconds to the first chunk with text (or to the end, for an answer that is empty): any model's."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": answer_tokens(prompt, tokens), "stream": True, "temperature": 0}
    t0 = time.perf_counter()
    first = None
    async with s.post(url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:200]}")
        if backends is not None:
            backends.append(r.headers.get("x-sluice-backend", "?"))
        async for line in r.content:
            if first is None and line.startswith(b"data: {"):
                chunk = json.loads(line[6:])
                if any((c.get("delta") or {}).get("content") for c in chunk.get("choices") or []):
                    first = time.perf_counter() - t0
    return first if first is not None else time.perf_counter() - t0


def _gateway(extra_toml: str, tmp: Path):
    cfg = tmp / "sluice.toml"
    cfg.write_text('[[models]]\nkind = "chat"\n' + extra_toml)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_WAIT_POLICY": "PASSIVE", "SLUICE_CONFIG": str(cfg),
           "SLUICE_AUTH__KEYS_FILE": str(tmp / "keys.json"), "SLUICE_USAGE__ENABLED": "false"}
    keys = {}
    for tier in ("pro", "standard"):
        keys[tier] = subprocess.run([sys.executable, "-m", "gateway.cli", "keys", "create", "--name", tier, "--tier",
                                     tier], env=env, cwd=ROOT, capture_output=True, text=True,
                                    check=True).stdout.strip()
    port = free_port()
    return managed_server([sys.executable, "-m", "gateway.cli", "serve", "--port", str(port)],
                          f"http://127.0.0.1:{port}/ready", env, cwd=ROOT), f"http://127.0.0.1:{port}", keys


async def _capacity(base: str, key: str, prompts: list[str], tokens: int, concurrency: int, seconds: float) -> float:
    return await closed_loop(lambda s, k: ttft(s, base, prompts[k % len(prompts)], tokens, key), concurrency,
                             concurrency, seconds)


async def run(args: argparse.Namespace) -> None:
    prompts = [f"Question {i}: tell me about item {i} in one or two sentences." for i in range(64)]
    chat_lengths(prompts)
    targets = {"pro": args.pro_target_ms, "standard": args.standard_target_ms}
    cloud = argparse.Namespace(max_running=4096, decode_ms=args.cloud_decode_ms, per_seq_ms=0.0,
                               prefill_ms_per_token=0.0)
    print(f"bench.slo_embedded on {cpu_model()} ({os.cpu_count()} CPUs): the packaged model in `sluice serve`; "
          f"targets (TTFT): pro {targets['pro']:.0f} ms, standard {targets['standard']:.0f} ms; goal: p99 <= target "
          f"+ 20%; {args.seconds:.0f} s per load, {args.pro:.0%} pro")
    tiers = SLO_TOML.format(**targets)
    with replicas(1, cloud) as prov:
        variants = (("with a provider", tiers + provider_toml(prov.urls[0])),
                    ("engine only (refuse_past_target)", tiers + "\n[routing]\nrefuse_past_target = true\n"))
        cap = None
        for label, extra in variants:
            server, base, keys = _gateway(extra, Path(tempfile.mkdtemp(prefix="sluice-slo-")))
            with server:
                if cap is None:
                    await _capacity(base, keys["pro"], prompts, args.tokens, args.concurrency, 3.0)  # warm-up
                    cap = await _capacity(base, keys["pro"], prompts, args.tokens, args.concurrency, args.cap_seconds)
                    print(f"engine capacity: {cap:.2f} requests/s (closed loop, {args.concurrency} streams)")
                print(f"-- {label}")
                for mult in args.mults:
                    plan = arrivals(mult * cap, args.seconds, args.pro, prompts, seed=int(mult * 10))

                    async def send(s: aiohttp.ClientSession, i: int, a: Arrival, backends: list[str]) -> float:
                        return await ttft(s, base, a.prompt, args.tokens, keys[a.tier], backends)

                    t, served, refused = await run_counted(plan, send)
                    n = max(1, len(plan))
                    print(f"  {mult:3.1f}x ({mult * cap:5.2f}/s, n={len(plan):4d}): " + slo_cells(t, targets) +
                          f"  local {served.get('local', 0) / n:5.1%} remote {served.get('remote', 0) / n:5.1%} "
                          f"429 {refused / n:5.1%}")
                    print(f"        by server: {by_server(t)}")
                    await asyncio.sleep(2.0)  # the engine drains before the next load


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--cap-seconds", type=float, default=10.0)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--pro", type=float, default=0.3)
    ap.add_argument("--tokens", type=int, default=16, help="the mean answer length's scale (bench.pools)")
    ap.add_argument("--pro-target-ms", type=float, default=1500.0)
    ap.add_argument("--standard-target-ms", type=float, default=3000.0)
    ap.add_argument("--cloud-decode-ms", type=float, default=20.0)
    ap.add_argument("--mults", type=lambda v: [float(x) for x in v.split(",")], default=[0.5, 1.0, 2.0, 3.0],
                    help="offered loads, as multiples of the measured capacity")
    asyncio.run(run(ap.parse_args(argv)))


if __name__ == "__main__":
    main()
