"""Through the gateway with the OpenAI SDK: requests/s, output tokens/s, TTFT and latency at concurrency 1 and 32.

Starts its own `sluice serve` (default model, embedded engine) unless --url is given.

    python -m bench.gateway_load [--requests 64] [--concurrency 1,32] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib

from bench.common import mixed_workload
from bench.load import run_load
from bench.server import sluice_server


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="an already running OpenAI-compatible base URL (…/v1)")
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", default="1,32")
    ap.add_argument("--min-tokens", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    a = ap.parse_args(argv)
    levels = [int(c) for c in a.concurrency.split(",")]
    ctx = contextlib.nullcontext(a.url) if a.url else sluice_server()
    with ctx as url:
        results = []
        for c in levels:
            n = a.requests if c > 1 else max(8, a.requests // 8)
            work = mixed_workload(n, a.min_tokens, a.max_tokens, seed=c)
            results.append(asyncio.run(run_load(url, a.model, work, c)))
            print(results[-1].line("gateway"), flush=True)
        if len(results) > 1:
            lo, hi = results[0], results[-1]
            print(f"ratio output tokens/s c={hi.concurrency} / c={lo.concurrency}: "
                  f"{(hi.output_tokens / hi.wall) / (lo.output_tokens / lo.wall):.1f}x")


if __name__ == "__main__":
    main()
