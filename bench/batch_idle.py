"""The Batch API's lane on a fresh `sluice serve`: a chat batch on an idle engine against the same requests
sent by a closed loop at the batch's concurrency (lines/s ratio), then interactive requests' TTFT while
the batch drains against the same requests with no batch (p50 and p99 ratios).

    python -m bench.batch_idle [--lines 256] [--max-tokens 32] [--concurrency 48] [--interactive 40]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import openai

from bench.common import TOPICS, pct
from bench.server import sluice_server_process
from bench.structured import cpu_model


def _body(model: str, i: int, max_tokens: int) -> dict:
    return {"model": model, "max_tokens": max_tokens, "temperature": 0, "messages": [
        {"role": "user", "content": f"Tell me about {TOPICS[i % len(TOPICS)]} (note {i})."}]}


async def closed_loop(c: openai.AsyncOpenAI, bodies: list[dict], concurrency: int) -> float:
    queue = list(bodies)

    async def worker() -> None:
        while queue:
            await c.chat.completions.create(**queue.pop())
    t = time.perf_counter()
    await asyncio.gather(*[worker() for _ in range(concurrency)])
    return len(bodies) / (time.perf_counter() - t)


async def submit(c: openai.AsyncOpenAI, bodies: list[dict]) -> str:
    data = "\n".join(json.dumps({"custom_id": f"l{i}", "method": "POST", "url": "/v1/chat/completions", "body": b})
                     for i, b in enumerate(bodies)).encode()
    f = await c.files.create(file=("b.jsonl", data), purpose="batch")
    return (await c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")).id


async def wait(c: openai.AsyncOpenAI, bid: str) -> None:
    while (await c.batches.retrieve(bid)).status not in ("completed", "failed", "cancelled", "expired"):
        await asyncio.sleep(0.1)


async def ttfts(c: openai.AsyncOpenAI, model: str, n: int, gap_s: float) -> list[float]:
    async def one(i: int) -> float:
        t = time.perf_counter()
        stream = await c.chat.completions.create(stream=True, **_body(model, 10_000 + i, 16))
        first = None
        async for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.perf_counter() - t
        return first if first is not None else time.perf_counter() - t
    tasks = []
    for i in range(n):
        tasks.append(asyncio.create_task(one(i)))
        await asyncio.sleep(gap_s)
    return list(await asyncio.gather(*tasks))


async def run(args: argparse.Namespace) -> None:
    env = {"SLUICE_BATCHES__MAX_IN_FLIGHT": str(args.concurrency)}
    with sluice_server_process(env) as (url, _):
        c = openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)
        model = (await c.models.list()).data[0].id
        bodies = [_body(model, i, args.max_tokens) for i in range(args.lines)]
        await closed_loop(c, bodies[:args.concurrency], args.concurrency)  # warm
        loop_rate = await closed_loop(c, bodies, args.concurrency)
        t = time.perf_counter()
        await wait(c, await submit(c, bodies))
        batch_rate = args.lines / (time.perf_counter() - t)
        print(f"idle engine: batch {batch_rate:.2f} lines/s, closed loop at c={args.concurrency} {loop_rate:.2f} "
              f"requests/s: {batch_rate / loop_rate:.2f}x (goal >= 0.8x)")
        quiet = await ttfts(c, model, args.interactive, args.gap)
        bid = await submit(c, bodies)
        await asyncio.sleep(2)
        busy = await ttfts(c, model, args.interactive, args.gap)
        await wait(c, bid)
        for name, q in (("p50", 50), ("p99", 99)):
            a, b = pct(quiet, q), pct(busy, q)
            print(f"interactive TTFT {name}: {a * 1e3:.0f} ms alone, {b * 1e3:.0f} ms beside the batch: {b / a:.2f}x")
        print(f"(interactive: {args.interactive} streamed requests, one every {args.gap} s; "
              f"median alone {statistics.median(quiet) * 1e3:.0f} ms)")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lines", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=48)  # [batches] max_in_flight's default
    ap.add_argument("--interactive", type=int, default=40)
    ap.add_argument("--gap", type=float, default=0.25)
    args = ap.parse_args(argv)
    print(f"CPU: {cpu_model()}")
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
