"""Embeddings beside chat in one `sluice serve` (default configuration: SmolLM2 and all-MiniLM-L6-v2).

Priority: a pro key's one-line query and a chat request's time to first token, idle and while a standard
key ingests 2,048-input requests back to back (the issue's goals: query p50 <= 3x idle, chat TTFT p50 <=
2x idle). Both sides are measured in the same run, so the ratios hold on a shared machine.

Memory: the server's RSS once ready (and after a first request to each model) with both models and with
the chat model alone, and how long each took from start to answering /health and to /ready.

    python -m bench.embeddings_serving [--queries 20] [--chats 10] [--skip-memory]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from bench.server import free_port, sluice_server_process
from gateway.admission.keys import KeyStore

EMB, CHAT = "all-MiniLM-L6-v2", "SmolLM2-135M-Instruct"


def _lscpu() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    keep = ("Model name", "CPU(s):", "Flags")
    lines = [ln for ln in out.splitlines() if ln.startswith(keep)]
    return "\n".join(ln if not ln.startswith("Flags") else
                     "Flags: " + " ".join(f for f in ln.split() if f.startswith(("avx512", "amx", "avx2")))
                     for ln in lines)


async def _query(s: aiohttp.ClientSession, url: str, key: str, text: str) -> float:
    t0 = time.perf_counter()
    async with s.post(url + "/embeddings", json={"model": EMB, "input": text},
                      headers={"Authorization": f"Bearer {key}"}) as r:
        body = await r.json()
        assert r.status == 200, body
    return time.perf_counter() - t0


async def _ttft(s: aiohttp.ClientSession, url: str, key: str, i: int) -> float:
    t0 = time.perf_counter()
    body = {"model": CHAT, "messages": [{"role": "user", "content": f"Name a colour ({i})."}], "max_tokens": 8,
            "temperature": 0, "stream": True}
    async with s.post(url + "/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as r:
        assert r.status == 200, await r.text()
        first = None
        async for line in r.content:
            if first is None and line.startswith(b"data: {") and b'"content":"' in line:
                first = time.perf_counter() - t0
        assert first is not None
    return first


async def _measure(s: aiohttp.ClientSession, url: str, key: str, queries: int, chats: int) -> tuple[list, list]:
    q = []
    for i in range(queries):
        q.append(await _query(s, url, key, f"what did the committee decide about item {i}?"))
        await asyncio.sleep(0.1)
    c = []
    for i in range(chats):
        c.append(await _ttft(s, url, key, i))
        await asyncio.sleep(0.1)
    return q, c


async def priority(url: str, pro: str, std: str, queries: int, chats: int) -> None:
    passages = [f"Passage {i}: the committee met on a Tuesday to discuss the budget, the river and the "
                f"school roof, and agreed to meet again in {i % 12 + 1} weeks." for i in range(2048)]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        await _query(s, url, pro, "warm up")
        await _ttft(s, url, pro, -1)
        idle_q, idle_c = await _measure(s, url, pro, queries, chats)
        stop = asyncio.Event()
        ingested = [0, 0.0]

        async def ingest() -> None:
            while not stop.is_set():
                t0 = time.perf_counter()
                async with s.post(url + "/embeddings", json={"model": EMB, "input": passages},
                                  headers={"Authorization": f"Bearer {std}"}) as r:
                    assert r.status == 200, await r.text()
                    await r.read()
                ingested[0] += 1
                ingested[1] += time.perf_counter() - t0

        task = asyncio.create_task(ingest())
        await asyncio.sleep(2.0)
        busy_q, busy_c = await _measure(s, url, pro, queries, chats)
        stop.set()
        await task
    p50 = statistics.median
    print(f"\npro one-line query latency p50: idle {p50(idle_q) * 1000:.1f} ms, during the ingest "
          f"{p50(busy_q) * 1000:.1f} ms -> {p50(busy_q) / p50(idle_q):.2f}x idle (goal <= 3x); "
          f"max {max(busy_q) * 1000:.0f} ms")
    print(f"chat TTFT p50: idle {p50(idle_c) * 1000:.1f} ms, during the ingest {p50(busy_c) * 1000:.1f} ms -> "
          f"{p50(busy_c) / p50(idle_c):.2f}x idle (goal <= 2x)")
    if ingested[0]:
        print(f"ingest: {ingested[0]} requests of 2,048 inputs, {ingested[1] / ingested[0]:.1f} s each "
              f"({2048 * ingested[0] / ingested[1]:.0f} inputs/s while queries and chats ran)")


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _start_times(env: dict[str, str]) -> tuple[float, float, float, float]:
    """(seconds to /health, seconds to /ready, RSS at ready, RSS after one request per model)."""
    import urllib.request

    port = free_port()
    tmp = tempfile.mkdtemp(prefix="sluice-bench-mem-")
    full = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "SLUICE_AUTH__KEYS_FILE": f"{tmp}/keys.json", **env}
    full.pop("SLUICE_CONFIG", None)
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--port", str(port)], env=full,
                            stdout=open(f"{tmp}/log", "w"), stderr=subprocess.STDOUT)
    health = ready = None
    try:
        while ready is None:
            if proc.poll() is not None:
                raise RuntimeError(Path(f"{tmp}/log").read_text()[-2000:])
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1):
                    health = health or time.perf_counter() - t0
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=1):
                    ready = time.perf_counter() - t0
            except OSError:
                time.sleep(0.05)
        rss_ready = _rss_mb(proc.pid)
        models = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models"))["data"]
        for m in models:
            path, body = (("embeddings", {"model": m["id"], "input": "hello"}) if m["id"] == EMB else
                          ("chat/completions", {"model": m["id"], "max_tokens": 4,
                                                "messages": [{"role": "user", "content": "hi"}]}))
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/{path}", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            urllib.request.urlopen(req, timeout=120).read()
        return health or ready, ready, rss_ready, _rss_mb(proc.pid)
    finally:
        proc.terminate()
        proc.wait(30)


def memory() -> None:
    both = _start_times({})
    chat = _start_times({"SLUICE_MODELS": json.dumps([{"kind": "chat"}])})
    print(f"\nmemory and start (RSS of `sluice serve`, MB):\n"
          f"  chat + embeddings: /health {both[0]:.2f} s, /ready {both[1]:.1f} s, RSS {both[2]:.0f} at ready, "
          f"{both[3]:.0f} after a request to each\n"
          f"  chat alone:        /health {chat[0]:.2f} s, /ready {chat[1]:.1f} s, RSS {chat[2]:.0f} at ready, "
          f"{chat[3]:.0f} after a request\n"
          f"  the embedding model adds {both[3] - chat[3]:.0f} MB after requests ({both[2] - chat[2]:.0f} MB at "
          f"ready; goal <= 150 MB)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--queries", type=int, default=20)
    ap.add_argument("--chats", type=int, default=10)
    ap.add_argument("--skip-memory", action="store_true")
    args = ap.parse_args()
    print(_lscpu())
    tmp = Path(tempfile.mkdtemp(prefix="sluice-bench-keys-"))
    store = KeyStore(tmp / "keys.json")
    pro, std = store.create("bench-pro", "pro"), store.create("bench-standard", "standard")
    with sluice_server_process({"SLUICE_AUTH__KEYS_FILE": str(tmp / "keys.json")}) as (url, _):
        asyncio.run(priority(url, pro, std, args.queries, args.chats))
    if not args.skip_memory:
        memory()


if __name__ == "__main__":
    main()
