"""Long prompts arriving while 16 streams decode: the streams' inter-token latency with and without chunked prefill.

    python -m bench.chunked_prefill [--streams 16] [--long-prompts 4] [--long-tokens 1500] [--chunk 128]
"""

from __future__ import annotations

import argparse

from bench.common import pct
from bench.driver import run
from engine import EngineConfig, EngineRequest, LLMEngine, SamplingParams


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--stream-tokens", type=int, default=96)
    ap.add_argument("--long-prompts", type=int, default=4)
    ap.add_argument("--long-tokens", type=int, default=1500)
    ap.add_argument("--chunk", type=int, default=128)
    a = ap.parse_args(argv)
    # Token budget: the streams' decodes plus one chunk, so one step never holds more than a chunk of prefill.
    engine = LLMEngine(EngineConfig(max_running_requests=32, kv_cache_tokens=65536, enable_prefix_caching=False,
                                    max_num_batched_tokens=max(a.long_tokens + 8, 4096), chunked_prefill_size=a.chunk))
    long_text = " ".join(f"Paragraph {i} describes rivers, rain and the sea in some detail." for i in range(a.long_tokens // 12))
    res = {}
    for chunk in (0, a.chunk):
        engine.config.chunked_prefill_size = chunk
        engine.config.max_num_batched_tokens = chunk + a.streams if chunk else max(a.long_tokens + 8, 4096)
        arrivals = [(0.0, EngineRequest(f"s{chunk}-{i}", engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Tell me story number {i}."}]),
            SamplingParams(temperature=0, max_tokens=a.stream_tokens, ignore_eos=True))) for i in range(a.streams)]
        ids = engine.tokenizer.encode(long_text)[:a.long_tokens]
        arrivals += [(1.0 + 0.5 * j, EngineRequest(f"l{chunk}-{j}", ids + [j], SamplingParams(temperature=0, max_tokens=4)))
                     for j in range(a.long_prompts)]
        tl = run(engine, arrivals)
        gaps = [g for rid, x in tl.items() if rid.startswith("s") for g in x.gaps()]
        long_ttft = [x.ttft for rid, x in tl.items() if rid.startswith("l")]
        res[chunk] = (pct(gaps, 50), pct(gaps, 99), max(gaps), pct(long_ttft, 50))
        name = f"chunked prefill {chunk:4d}" if chunk else "no chunking         "
        print(f"{name}: stream ITL p50 {res[chunk][0] * 1000:6.0f} ms  p99 {res[chunk][1] * 1000:6.0f} ms  "
              f"max {res[chunk][2] * 1000:6.0f} ms   long-prompt TTFT p50 {res[chunk][3]:.2f} s")
    print(f"ratio stream ITL p99 off/on: {res[0][1] / res[a.chunk][1]:.1f}x  "
          f"(long-prompt TTFT on/off: {res[a.chunk][3] / res[0][3]:.2f}x)")


if __name__ == "__main__":
    main()
