"""Time to first token of one long prompt: Sluice against llama.cpp's `llama-server` on the same GGUF.

A prompt of random token ids near the context limit (8,191 of SmolLM2's 8,192 by default), one token of
output, nothing else running: what the prefill of a long context costs, attention included. Both
servers run at once and are asked in turn, in alternating order each round, each round with a new
prompt (the same one to both), so neither serves from a prefix cache and slow drift of a shared machine
hits both. llama-server gets `-t 2 -np 1 -c 8192 --no-repack` and llama.cpp's own defaults otherwise.

    bash bench/setup_llama_server.sh && python -m bench.long_prefill [--tokens 8191] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from pathlib import Path

import aiohttp

from bench.common import machine
from bench.server import sluice_server_process
from bench.vs_llamacpp import MODEL, llama_server


async def ttft(url: str, prompt: list[int]) -> float:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as s:
        t = time.perf_counter()
        async with s.post(url + "/completions", json=body) as r:
            text = await r.text()
            if r.status != 200:
                raise RuntimeError(f"{url}: {r.status} {text[:200]}")
        return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8191)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--llama-server", default="bench/.llama-server/build/bin/llama-server")
    args = ap.parse_args()
    print(machine())
    binary = Path(args.llama_server)
    rng = random.Random(0)
    times: dict[str, list[float]] = {"sluice": [], "llama-server": []}
    with sluice_server_process() as (sluice_url, _), llama_server(binary, 1, 8192) as (llama_url, _):
        urls = {"sluice": sluice_url, "llama-server": llama_url}
        asyncio.run(ttft(sluice_url, [rng.randrange(1000, 40000) for _ in range(64)]))  # warm both
        asyncio.run(ttft(llama_url, [rng.randrange(1000, 40000) for _ in range(64)]))
        for i in range(args.rounds):
            prompt = [rng.randrange(1000, 40000) for _ in range(args.tokens)]
            order = ["sluice", "llama-server"] if i % 2 == 0 else ["llama-server", "sluice"]
            for name in order:
                times[name].append(asyncio.run(ttft(urls[name], prompt)))
                print(f"round {i + 1}: {name:12s} TTFT {times[name][-1]:7.2f} s", flush=True)
    s, ll = statistics.median(times["sluice"]), statistics.median(times["llama-server"])
    print(f"\n{args.tokens}-token prompt, TTFT median of {args.rounds}: sluice {s:.2f} s, llama-server {ll:.2f} s; "
          f"sluice/llama-server {s / ll:.2f}x (below 1: Sluice is faster)")


if __name__ == "__main__":
    main()
