"""The Batch API's lane on a fresh `sluice serve`, in three parts (each can run alone, `--part`):

1. idle: a chat batch (2,000 lines) on an idle engine against the same requests sent by a closed loop at
   the engine's best concurrency (tried first on a sample): the lines/s ratio (goal >= 0.8x).
2. interactive: a Poisson load of streamed requests at half the engine's capacity (the closed loop's
   rate), alone and while a batch drains: TTFT p50 (goal <= 1.3x) and p99 (<= 2x), inter-token p99 (<= 1.5x).
3. alternate: one batch drains for `--minutes` (10) minutes of alternating busy (that Poisson load) and
   idle minutes: the engine's busy ratio over the run (goal >= 85%; from its cumulative step time), the
   batch's lines/s in busy and in idle minutes, and the interactive ratios in the busy minutes against
   part 2's load alone.

    python -m bench.batch_idle [--part all|idle|interactive|alternate] [--lines 2000] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import time
from dataclasses import dataclass, field

import aiohttp
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


async def answered(c: openai.AsyncOpenAI, bid: str) -> int:
    counts = (await c.batches.retrieve(bid)).request_counts
    return counts.completed + counts.failed if counts else 0


@dataclass
class Latency:
    """Interactive requests' time to first token and the gaps between their tokens."""
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)

    def ratios(self, base: Latency) -> str:
        parts = []
        for name, mine, theirs, q, goal in (("TTFT p50", self.ttft, base.ttft, 50, 1.3),
                                            ("TTFT p99", self.ttft, base.ttft, 99, 2.0),
                                            ("ITL p99", self.itl, base.itl, 99, 1.5)):
            a, b = pct(theirs, q), pct(mine, q)
            parts.append(f"{name} {a * 1e3:.0f} -> {b * 1e3:.0f} ms = {b / a:.2f}x (goal <= {goal}x)")
        return "; ".join(parts)


async def poisson(c: openai.AsyncOpenAI, model: str, rate: float, seconds: float, max_tokens: int,
                  out: Latency, seed: int) -> int:
    """Streamed requests arriving at `rate` per second (exponential gaps) for `seconds`; returns how many."""
    rng = random.Random(seed)

    async def one(i: int) -> None:
        t = time.perf_counter()
        last = None
        stream = await c.chat.completions.create(stream=True, **_body(model, 100_000 + seed * 10_000 + i, max_tokens))
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                now = time.perf_counter()
                if last is None:
                    out.ttft.append(now - t)
                else:
                    out.itl.append(now - last)
                last = now
    tasks = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        tasks.append(asyncio.create_task(one(len(tasks))))
        await asyncio.sleep(rng.expovariate(rate))
    await asyncio.gather(*tasks)
    return len(tasks)


async def busy_seconds(s: aiohttp.ClientSession, base: str) -> float:
    async with s.get(base + "/metrics") as r:
        text = await r.text()
    return sum(float(m.group(1)) for m in re.finditer(r"^sluice_engine_busy_seconds(?:\{[^}]*\})? (\S+)$", text,
                                                      re.M))


async def capacity(c: openai.AsyncOpenAI, model: str, max_tokens: int) -> tuple[int, float]:
    """The closed loop's best concurrency (the rate of 3 x c requests at each) and that rate."""
    best = (0, 0.0)
    for conc in (16, 32, 48, 64):
        rate = await closed_loop(c, [_body(model, i, max_tokens) for i in range(3 * conc)], conc)
        print(f"  closed loop at c={conc}: {rate:.2f} requests/s")
        best = max(best, (conc, rate), key=lambda x: x[1])
    return best


async def run(args: argparse.Namespace) -> None:
    env = {"SLUICE_BATCHES__MAX_IN_FLIGHT": str(args.in_flight)}
    parts = {"idle", "interactive", "alternate"} if args.part == "all" else {args.part}
    with sluice_server_process(env) as (url, _):
        base = url.removesuffix("/v1")
        c = openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)
        model = (await c.models.list()).data[0].id
        await closed_loop(c, [_body(model, i, args.max_tokens) for i in range(64)], 32)  # warm
        conc, rate = await capacity(c, model, args.max_tokens)
        load = args.load * rate
        print(f"engine's best closed-loop concurrency {conc}: {rate:.2f} requests/s; interactive Poisson load "
              f"{load:.2f} requests/s ({args.load:.0%} of it), {args.max_tokens} tokens each, streamed")
        if "idle" in parts:
            bodies = [_body(model, i, args.max_tokens) for i in range(args.lines)]
            loop_rate = await closed_loop(c, bodies, conc)
            t = time.perf_counter()
            await wait(c, await submit(c, bodies))
            batch_rate = args.lines / (time.perf_counter() - t)
            print(f"[idle] {args.lines} lines: batch {batch_rate:.2f} lines/s, closed loop at c={conc} "
                  f"{loop_rate:.2f} requests/s: {batch_rate / loop_rate:.2f}x (goal >= 0.8x)")
        big = [_body(model, i, args.max_tokens) for i in range(args.big_lines)]
        alone = Latency()
        n = await poisson(c, model, load, args.window, args.max_tokens, alone, seed=1)
        print(f"[interactive] alone: {n} requests in {args.window:.0f} s")
        if "interactive" in parts:
            bid = await submit(c, big)
            await asyncio.sleep(3)
            beside = Latency()
            start = await answered(c, bid)
            t = time.perf_counter()
            n = await poisson(c, model, load, args.window, args.max_tokens, beside, seed=2)
            lines = (await answered(c, bid) - start) / (time.perf_counter() - t)
            await c.batches.cancel(bid)
            await wait(c, bid)
            print(f"[interactive] beside the batch ({n} requests; the batch {lines:.2f} lines/s meanwhile): "
                  f"{beside.ratios(alone)}")
        if "alternate" in parts:
            await alternate(c, base, model, big, load, alone, args)


async def alternate(c: openai.AsyncOpenAI, base: str, model: str, big: list[dict], load: float, alone: Latency,
                    args: argparse.Namespace) -> None:
    bid = await submit(c, big)
    busy_lat = Latency()
    per: dict[str, list[float]] = {"busy": [], "idle": []}
    async with aiohttp.ClientSession() as s:
        b0, t0 = await busy_seconds(s, base), time.perf_counter()
        for minute in range(args.minutes):
            kind = "busy" if minute % 2 == 0 else "idle"
            b1, t1, d1 = await busy_seconds(s, base), time.perf_counter(), await answered(c, bid)
            if kind == "busy":
                await poisson(c, model, load, args.minute_s, args.max_tokens, busy_lat, seed=10 + minute)
                await asyncio.sleep(max(0.0, args.minute_s - (time.perf_counter() - t1)))
            else:
                await asyncio.sleep(args.minute_s)
            b2, t2, d2 = await busy_seconds(s, base), time.perf_counter(), await answered(c, bid)
            per[kind].append((d2 - d1) / (t2 - t1))
            print(f"  minute {minute + 1} ({kind}): engine busy {(b2 - b1) / (t2 - t1):.1%}, "
                  f"batch {(d2 - d1) / (t2 - t1):.2f} lines/s")
        b3, t3 = await busy_seconds(s, base), time.perf_counter()
    left = len(big) - await answered(c, bid)
    await c.batches.cancel(bid)
    await wait(c, bid)
    print(f"[alternate] {args.minutes} minutes of {args.minute_s:.0f} s: engine busy {(b3 - b0) / (t3 - t0):.1%} "
          f"(goal >= 85%); batch lines/s busy minutes {sum(per['busy']) / len(per['busy']):.2f}, idle minutes "
          f"{sum(per['idle']) / max(1, len(per['idle'])):.2f} ({left} of {len(big)} lines left, cancelled)")
    print(f"[alternate] interactive in busy minutes vs alone: {busy_lat.ratios(alone)}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=("all", "idle", "interactive", "alternate"), default="all")
    ap.add_argument("--lines", type=int, default=2000)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--in-flight", type=int, default=48)  # [batches] max_in_flight's default
    ap.add_argument("--load", type=float, default=0.5, help="the interactive load, a share of capacity")
    ap.add_argument("--window", type=float, default=30.0, help="seconds of interactive load per measurement")
    ap.add_argument("--big-lines", type=int, default=30_000, help="the batch that drains under interactive load")
    ap.add_argument("--minutes", type=int, default=10)
    ap.add_argument("--minute-s", type=float, default=60.0)
    args = ap.parse_args(argv)
    print(f"CPU: {cpu_model()}")
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
