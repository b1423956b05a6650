"""RAG workload: many requests share a long retrieved context and differ in a short question.

TTFT p50 and throughput with prefix caching on and off, in one run (ratios are what to read).

    python -m bench.prefix_cache [--requests 64] [--context-tokens 1000] [--max-tokens 16]
"""

from __future__ import annotations

import argparse
import time

from bench.common import TOPICS, pct
from bench.driver import run
from engine import EngineConfig, EngineRequest, LLMEngine, SamplingParams


def context_text(engine: LLMEngine, tokens: int) -> str:
    sentences, text = 0, ""
    while len(engine.tokenizer.encode(text)) < tokens:
        t = TOPICS[sentences % len(TOPICS)]
        text += f"Document {sentences}: notes on {t}, its history, its uses and the people who study {t}. "
        sentences += 1
    return text


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--context-tokens", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--max-running", type=int, default=64)
    a = ap.parse_args(argv)
    engine = LLMEngine(EngineConfig(max_running_requests=a.max_running, kv_cache_tokens=80000))
    ctx = context_text(engine, a.context_tokens)
    results = {}
    for caching in (False, True):
        engine.config.enable_prefix_caching = caching
        engine.block_manager.enable_prefix_caching = caching
        engine.block_manager.reset_prefix_cache()
        reqs = [(0.0, EngineRequest(f"{caching}-{i}", engine.tokenizer.apply_chat_template([
            {"role": "system", "content": "Answer from the context.\n\n" + ctx},
            {"role": "user", "content": f"Question {i}: what do the notes say about {TOPICS[i % len(TOPICS)]}?"}]),
            SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True))) for i in range(a.requests)]
        t0 = time.perf_counter()
        tl = run(engine, reqs)
        wall = time.perf_counter() - t0
        ttfts = [x.ttft for x in tl.values()]
        results[caching] = (pct(ttfts, 50), pct(ttfts, 99), a.requests / wall, sum(x.cached_tokens for x in tl.values()))
        print(f"prefix caching {'on ' if caching else 'off'}: TTFT p50 {results[caching][0]:7.2f} s  "
              f"p99 {results[caching][1]:7.2f} s  {results[caching][2]:6.2f} req/s  "
              f"cached prompt tokens {results[caching][3]}  (prompt {len(reqs[0][1].prompt_token_ids)} tokens)")
    print(f"ratio TTFT p50 off/on: {results[False][0] / results[True][0]:.1f}x   "
          f"throughput on/off: {results[True][2] / results[False][2]:.1f}x")


if __name__ == "__main__":
    main()
