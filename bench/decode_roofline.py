"""Decode step time at several batch sizes against this machine's memory-bandwidth bound.

Bound = bytes a decode step must read (every weight once, plus each sequence's K/V) divided by the
read bandwidth measured here, in this process, just before.

    python -m bench.decode_roofline [--batches 1,8,32,64] [--context 256]
"""

from __future__ import annotations

import argparse
import time

import torch

from engine import EngineConfig, EngineRequest, LLMEngine, SamplingParams


def read_bandwidth(nbytes: int = 512 * 2**20) -> float:
    """Bytes/s of a large streaming read (a sum over a buffer far bigger than the caches)."""
    x = torch.ones(nbytes // 4)
    x.sum()
    best = 0.0
    for _ in range(5):
        t = time.perf_counter()
        x.sum()
        best = max(best, nbytes / (time.perf_counter() - t))
    return best


def weight_bytes(engine: LLMEngine) -> int:
    m = engine.runner.model
    head = m.lm_head_fast or m.lm_head  # the output layer actually read each step
    total = head.weight.numel() * head.weight.element_size()
    for layer in m.layers:
        for lin in (layer.qkv, layer.o, layer.gate_up, layer.down):
            total += lin.weight.numel() * lin.weight.element_size()
    return total


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--context", type=int, default=256, help="tokens of context per sequence")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--weight-dtype", default="auto")
    a = ap.parse_args(argv)
    engine = LLMEngine(EngineConfig(max_running_requests=64, kv_cache_tokens=65536, enable_prefix_caching=False,
                                    weight_dtype=a.weight_dtype))
    bw = read_bandwidth()
    wbytes = weight_bytes(engine)
    print(f"read bandwidth {bw / 1e9:.1f} GB/s; weights read per step {wbytes / 2**20:.0f} MiB "
          f"({str(engine.runner.weight_dtype).removeprefix('torch.')} weights)")
    for b in [int(x) for x in a.batches.split(",")]:
        reqs = [EngineRequest(f"{b}-{i}", [(i * 7 + j) % 1000 + 100 for j in range(a.context)],
                              SamplingParams(temperature=0, max_tokens=a.steps + 5, ignore_eos=True)) for i in range(b)]
        for r in reqs:
            engine.add_request(r)
        while any(s.is_prefilling for s in engine.scheduler.running) or engine.num_waiting:
            engine.step()
        engine.step()
        t = time.perf_counter()
        for _ in range(a.steps):
            engine.step()
        step = (time.perf_counter() - t) / a.steps
        kv = b * (a.context + a.steps) * engine.runner.kv_bytes_per_token
        bound = (wbytes + kv) / bw
        print(f"batch {b:3d}: step {step * 1000:7.1f} ms  {b / step:7.1f} tok/s   bound {bound * 1000:6.1f} ms   "
              f"fraction of bound {bound / step:5.2f}")
        for r in reqs:
            engine.abort(r.request_id)


if __name__ == "__main__":
    main()
