"""What the Redis hop costs: the same workload through the in-process queue and through Redis (one
worker), with a trivial engine (one token per request, no compute), so only the queue is measured.

  * latency: requests one at a time, put -> final output received (p50/p99), and the Redis/memory
    difference (the goal: under 1 ms added at p50);
  * throughput: `--concurrency` requests in flight, requests/s;
  * fill/time pulls: for each (fill_target, max_wait_ms), latency and pull round trips per request
    under the same concurrent load (what waiting to fill a batch costs in TTFT and saves in trips).

    python -m bench.queue_hop [--redis-url URL] [--requests 2000] [--concurrency 64]

Without --redis-url it starts a throwaway redis-server on a free port (needs redis-server).
The gateway side and the worker side use separate Redis connections in one process.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import pct
from engine import EngineRequest, SamplingParams
from gateway.messages import QueueItem
from gateway.queue.memory import MemoryQueue
from gateway.worker.worker import EngineWorker
from tests.fixtures.fake_engine import FakeEngine


def _item(rid: str) -> QueueItem:
    return QueueItem(request=EngineRequest(request_id=rid, prompt_token_ids=[97, 98],
                                           sampling=SamplingParams(max_tokens=1)), tier="standard")


async def _one(gw, rid: str) -> float:
    t0 = time.perf_counter()
    sub = await gw.subscribe(rid)
    await gw.put(_item(rid))
    while not (await sub.get(timeout=30)).finished:
        pass
    dt = time.perf_counter() - t0
    await sub.close()
    return dt


async def _setup(kind: str, url: str | None, fill: int, wait_ms: float):
    kw = dict(fill_target=fill, max_wait_ms=wait_ms, max_depth=1_000_000)
    if kind == "memory":
        gw = wq = MemoryQueue(**kw)
    else:
        from gateway.queue.redis import RedisQueue

        prefix = f"bench{uuid.uuid4().hex[:6]}"
        gw = RedisQueue(url, prefix=prefix, **kw)
        wq = RedisQueue(url, prefix=prefix, **kw)
    engine = FakeEngine(max_running_requests=256)
    worker = EngineWorker(engine, wq, max_batch=128, poll_s=0.5, idle_wait_s=0.001, heartbeat_s=1.0)
    await worker.start()
    return gw, wq, worker


async def _teardown(gw, wq, worker) -> None:
    await worker.stop()
    await gw.close()
    if wq is not gw:
        await wq.close()


async def run(kind: str, url: str | None, n: int, concurrency: int, fill: int = 1,
              wait_ms: float = 0.0) -> dict[str, float]:
    gw, wq, worker = await _setup(kind, url, fill, wait_ms)
    try:
        for i in range(50):  # warm up (connections, scripts)
            await _one(gw, f"w{i}")
        seq = [await _one(gw, f"s{i}") for i in range(n // 4)]
        pulls0 = getattr(wq, "pulls", 0)
        lat: list[float] = []
        sem = asyncio.Semaphore(concurrency)

        async def bounded(i: int) -> None:
            async with sem:
                lat.append(await _one(gw, f"c{i}"))

        t0 = time.perf_counter()
        await asyncio.gather(*(bounded(i) for i in range(n)))
        elapsed = time.perf_counter() - t0
        pulls = getattr(wq, "pulls", 0) - pulls0
    finally:
        await _teardown(gw, wq, worker)
    return {"p50_ms": pct(seq, 50) * 1e3, "p99_ms": pct(seq, 99) * 1e3, "rps": n / elapsed,
            "load_p50_ms": pct(lat, 50) * 1e3, "load_p99_ms": pct(lat, 99) * 1e3,
            "pulls_per_req": pulls / n if pulls else float("nan")}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--redis-url")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=64)
    args = ap.parse_args(argv)
    proc = None
    url = args.redis_url
    if url is None:
        if not shutil.which("redis-server"):
            sys.exit("redis-server not found: pass --redis-url or install it")
        port = _free_port()
        tmp = tempfile.mkdtemp()
        proc = subprocess.Popen(["redis-server", "--port", str(port), "--save", "", "--appendonly", "no",
                                 "--dir", tmp], stdout=subprocess.DEVNULL)
        time.sleep(0.5)
        url = f"redis://127.0.0.1:{port}/0"
    try:
        mem = asyncio.run(run("memory", None, args.requests, args.concurrency))
        red = asyncio.run(run("redis", url, args.requests, args.concurrency))
        print(f"queue hop, trivial engine, {args.requests} requests (latency: one at a time; "
              f"throughput: {args.concurrency} in flight)")
        print(f"{'':10} {'p50 ms':>8} {'p99 ms':>8} {'req/s':>9} {'p50@load':>9} {'p99@load':>9}")
        for name, r in (("memory", mem), ("redis", red)):
            print(f"{name:10} {r['p50_ms']:8.3f} {r['p99_ms']:8.3f} {r['rps']:9.0f} {r['load_p50_ms']:9.2f} "
                  f"{r['load_p99_ms']:9.2f}")
        print(f"redis adds {red['p50_ms'] - mem['p50_ms']:.3f} ms at p50 ({red['p50_ms'] / mem['p50_ms']:.1f}x), "
              f"{red['p99_ms'] - mem['p99_ms']:.3f} ms at p99 ({red['p99_ms'] / mem['p99_ms']:.1f}x); "
              f"throughput {red['rps'] / mem['rps']:.2f}x of in-process")
        print(f"\nfill/time pulls through redis, {args.concurrency} in flight:")
        print(f"{'fill':>5} {'wait ms':>8} {'p50 ms':>8} {'p99 ms':>8} {'req/s':>8} {'pulls/req':>10}")
        for fill, wait in ((1, 0), (1, 50), (8, 2), (8, 10), (32, 10), (32, 50)):
            r = asyncio.run(run("redis", url, args.requests, args.concurrency, fill, wait))
            print(f"{fill:5d} {wait:8.0f} {r['load_p50_ms']:8.2f} {r['load_p99_ms']:8.2f} {r['rps']:8.0f} "
                  f"{r['pulls_per_req']:10.3f}")
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait()


if __name__ == "__main__":
    main()
