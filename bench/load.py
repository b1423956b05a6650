"""An OpenAI-SDK load generator: N streamed chat requests at a given concurrency, with TTFT and latency."""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass

import openai

from bench.common import pct


@dataclass
class LoadResult:
    concurrency: int
    requests: int
    wall: float
    ttft: list[float]
    latency: list[float]
    output_tokens: int
    errors: int

    def line(self, label: str) -> str:
        return (f"{label} c={self.concurrency:<3d} {self.requests / self.wall:6.2f} req/s "
                f"{self.output_tokens / self.wall:7.1f} out tok/s  TTFT p50 {pct(self.ttft, 50) * 1000:7.0f} ms "
                f"p99 {pct(self.ttft, 99) * 1000:7.0f} ms  latency p50 {pct(self.latency, 50):6.2f} s "
                f"p99 {pct(self.latency, 99):6.2f} s  errors {self.errors}")


async def run_load(base_url: str, model: str, prompts: list[tuple[str, int]], concurrency: int,
                   api_key: str = "none", timeout: float = 900.0) -> LoadResult:
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=timeout)
    sem = asyncio.Semaphore(concurrency)
    ttfts: list[float] = []
    lats: list[float] = []
    tokens = [0]
    errors = [0]

    async def one(prompt: str, max_tokens: int) -> None:
        async with sem:
            for attempt in (1, 2):
                t0 = time.perf_counter()
                first = None
                chunks = 0
                usage_seen = False
                try:
                    stream = await client.chat.completions.create(
                        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
                        temperature=0, stream=True, stream_options={"include_usage": True})
                    async for chunk in stream:
                        if chunk.choices and chunk.choices[0].delta.content:
                            chunks += 1
                            if first is None:
                                first = time.perf_counter()
                        if chunk.usage is not None:
                            tokens[0] += chunk.usage.completion_tokens
                            usage_seen = True
                    if not usage_seen:  # servers that ignore include_usage: one content chunk per token
                        tokens[0] += chunks
                except Exception as e:
                    if isinstance(e, openai.APIConnectionError) and attempt == 1 and first is None:
                        # A pooled keep-alive connection the server had closed (llama-server's idle timeout):
                        # nothing was generated, so it is sent again once, timed from the new start.
                        continue
                    errors[0] += 1  # counted, and said: a failed request's tokens are not in the rate
                    print(f"  request failed: {e!r}"[:300], file=sys.stderr, flush=True)
                    return
                end = time.perf_counter()
                ttfts.append((first or end) - t0)
                lats.append(end - t0)
                return

    t0 = time.perf_counter()
    await asyncio.gather(*(one(p, n) for p, n in prompts))
    wall = time.perf_counter() - t0
    await client.close()
    return LoadResult(concurrency, len(prompts), wall, ttfts, lats, tokens[0], errors[0])
