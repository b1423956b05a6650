"""Continuous against static batching on the engine alone (no HTTP), both in one run.

Static batching (the baseline users compare with): a batch of `batch` requests starts together and
holds its slots until its longest member finishes, as a padded `generate()` call would; the next
batch waits for it. Continuous batching: a request joins at the next step and leaves when done.
Both use the same engine, the same requests and the same slot count; the ratio is what matters.

    python -m bench.engine_batching [--requests 64] [--batch 32] [--min-out 8] [--max-out 256]
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from bench.common import mixed_workload
from engine import EngineConfig, EngineRequest, LLMEngine, SamplingParams
from engine.block_manager import BlockManager
from engine.scheduler import Scheduler


def make_requests(engine: LLMEngine, workload, tag: str) -> list[EngineRequest]:
    return [EngineRequest(f"{tag}{i}", engine.tokenizer.apply_chat_template([{"role": "user", "content": p}]),
                          SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
            for i, (p, n) in enumerate(workload)]


def run_continuous(engine: LLMEngine, reqs: list[EngineRequest]) -> tuple[float, int]:
    t0 = time.perf_counter()
    out = engine.generate(reqs)
    return time.perf_counter() - t0, sum(o[-1].completion_tokens for o in out.values())


def run_static(engine: LLMEngine, reqs: list[EngineRequest], batch: int) -> tuple[float, int]:
    t0 = time.perf_counter()
    useful = 0
    for i in range(0, len(reqs), batch):
        group = reqs[i:i + batch]
        longest = max(r.sampling.max_tokens for r in group)
        # Every member occupies its slot (and is computed) until the longest one is done.
        padded = [EngineRequest(r.request_id, r.prompt_token_ids,
                                SamplingParams(temperature=0, max_tokens=longest, ignore_eos=True)) for r in group]
        engine.generate(padded)
        useful += sum(r.sampling.max_tokens for r in group)
    return time.perf_counter() - t0, useful


def same_memory_continuous(engine: LLMEngine, reqs: list[EngineRequest], batch: int) -> tuple[float, int, int]:
    """Continuous batching given only the KV memory static batching needs: static reserves, for each of
    its `batch` slots, room for the longest prompt plus the longest answer; paged continuous batching fills
    the same memory with as many sequences as their actual lengths allow (up to 4x the slots)."""
    reserve = max(len(r.prompt_token_ids) for r in reqs) + max(r.sampling.max_tokens for r in reqs)
    saved = (engine.config, engine.block_manager, engine.scheduler)
    engine.config = dataclasses.replace(saved[0], max_running_requests=4 * batch,
                                        max_num_batched_tokens=max(saved[0].max_num_batched_tokens, 4 * batch))
    engine.block_manager = BlockManager(batch * reserve // engine.config.block_size, engine.config.block_size, False)
    engine.scheduler = Scheduler(engine.config, engine.block_manager)
    try:
        t, useful = run_continuous(engine, reqs)
        return t, useful, engine.block_manager.num_blocks * engine.config.block_size
    finally:
        engine.config, engine.block_manager, engine.scheduler = saved


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--min-out", type=int, default=8)
    ap.add_argument("--max-out", type=int, default=256)
    ap.add_argument("--weight-dtype", default="auto")
    ap.add_argument("--dist", choices=("uniform", "longtail", "both"), default="both",
                    help="output-length spread (longtail: most answers short, a few long, as in chat)")
    a = ap.parse_args(argv)
    engine = LLMEngine(EngineConfig(max_running_requests=a.batch, kv_cache_tokens=65536, weight_dtype=a.weight_dtype,
                                    enable_prefix_caching=False))
    engine.generate(make_requests(engine, mixed_workload(2, 4, 8), "warm"))
    for dist in (("uniform", "longtail") if a.dist == "both" else (a.dist,)):
        work = mixed_workload(a.requests, a.min_out, a.max_out, dist=dist)
        t_static, useful_s = run_static(engine, make_requests(engine, work, f"s{dist}"), a.batch)
        t_cont, useful_c = run_continuous(engine, make_requests(engine, work, f"c{dist}"))
        t_mem, useful_m, pool = same_memory_continuous(engine, make_requests(engine, work, f"m{dist}"), a.batch)
        assert useful_s == useful_c == useful_m
        print(f"workload {dist}: {a.requests} requests, output {a.min_out}..{a.max_out} tokens "
              f"({useful_c} in all, mean {useful_c / a.requests:.0f}), {a.batch} slots")
        print(f"  static batching:     {t_static:8.1f} s  {useful_s / t_static:7.1f} useful output tokens/s")
        print(f"  continuous batching: {t_cont:8.1f} s  {useful_c / t_cont:7.1f} useful output tokens/s")
        print(f"  ratio continuous/static throughput: {t_static / t_cont:.2f}x (same slots)", flush=True)
        print(f"  continuous batching in static's KV memory ({pool} tokens, up to {4 * a.batch} running): "
              f"{t_mem:6.1f} s  {useful_m / t_mem:7.1f} useful output tokens/s")
        print(f"  ratio continuous/static throughput: {t_static / t_mem:.2f}x (same KV memory)", flush=True)


if __name__ == "__main__":
    main()
