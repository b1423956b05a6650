"""Embedding throughput: the encoder engine against sentence-transformers, same texts, same process.

A synthetic corpus of `--passages` passages (lengths uniform in 20-250 tokens, [CLS]/[SEP] included;
sentences of the model vocabulary's whole words) is embedded by sentence-transformers'
`encode(batch_size=32, normalize_embeddings=True)` and by `EmbeddingEngine` (tokenizing included:
requests of `--request-size` inputs, stepped to the end, vectors out as lists, as a worker would).
On a shared machine wall-clock rates swing with other processes' load, so the two take turns on
slices of `--slice` passages (which one goes first alternates) and each side's times add up over the
slices: both see the same load. (sentence-transformers sorts by length within each encode call: in a
slice of 1,000 passages its batches of 32 span ~7 tokens, ~3% padding, against ~1.5% sorting 2,000.)
The rate per CPU-second of this process (all its threads) is printed too: it counts only the work
done, and its ratio is the steadier one.

The engine's vectors are checked against the reference (min and mean cosine over the corpus). Then
`max_batch_tokens` is swept on the first `--sweep-passages` passages: inputs/s, and the mean step
time, which is what sets a query's latency under a bulk request (a step cannot be interrupted: a query
arriving during one waits for it, then runs in a step of its own).

    python -m bench.embeddings [--passages 10000] [--slice 1000] [--max-batch-tokens 1024]
                               [--sweep 256,512,1024,2048,4096] [--sweep-passages 1000] [--dtype auto]
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import time
from dataclasses import dataclass

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

from engine import EmbeddingConfig, EmbeddingEngine, EmbeddingRequest

FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")


def machine() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown (lscpu failed)"
    info = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    flags = set(info.get("Flags", "").split())
    return (f"{info.get('Model name', '?').strip()}, {info.get('CPU(s)', '?').strip()} CPUs, torch threads "
            f"{torch.get_num_threads()}; flags: " + " ".join(f for f in FLAGS if f in flags))


def corpus(engine: EmbeddingEngine, n: int, seed: int = 0) -> list[str]:
    """Passages of whole vocabulary words in sentences of 6-18 words, each `target` tokens long
    (target uniform in 20..250, the two special tokens included: every word and period is one token)."""
    rng = random.Random(seed)
    words = sorted(w for w in engine.tokenizer.vocab() if w.isalpha() and w.isascii() and len(w) > 2)
    texts = []
    for _ in range(n):
        target = rng.randint(20, 250) - 2
        tokens: list[str] = []
        while len(tokens) < target:
            sentence = [rng.choice(words) for _ in range(min(rng.randint(6, 18), target - len(tokens)))]
            tokens += [sentence[0].capitalize(), *sentence[1:]]
            if len(tokens) < target:
                tokens.append(".")
        texts.append(" ".join(tokens).replace(" .", "."))
    return texts


@dataclass
class Run:
    seconds: float
    cpu_seconds: float
    vectors: torch.Tensor
    steps: int = 0

    @staticmethod
    def total(runs: list[Run]) -> Run:
        return Run(sum(r.seconds for r in runs), sum(r.cpu_seconds for r in runs),
                   torch.cat([r.vectors for r in runs]), sum(r.steps for r in runs))

    def rate(self, n: int) -> str:
        return f"{n / self.seconds:8.1f} inputs/s  ({n / self.cpu_seconds:7.1f} per CPU-second)"


def run_reference(model, texts: list[str]) -> Run:
    t, c = time.perf_counter(), time.process_time()
    v = model.encode(texts, batch_size=32, normalize_embeddings=True, convert_to_tensor=True)
    return Run(time.perf_counter() - t, time.process_time() - c, v.float().cpu())


def run_engine(engine: EmbeddingEngine, texts: list[str], request_size: int) -> Run:
    steps0 = engine.stats.steps
    t, c = time.perf_counter(), time.process_time()
    out: list[list[float]] = [[] for _ in texts]
    for start in range(0, len(texts), request_size):
        ids = engine.tokenize(texts[start:start + request_size], truncate=True)
        engine.add_request(EmbeddingRequest(f"bench-{start}", ids))
    while engine.has_unfinished():
        for o in engine.step():
            out[int(o.request_id.removeprefix("bench-")) + o.index] = o.embedding
    seconds, cpu = time.perf_counter() - t, time.process_time() - c
    return Run(seconds, cpu, torch.tensor(out), engine.stats.steps - steps0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--passages", type=int, default=10_000)
    ap.add_argument("--slice", type=int, default=1000, help="passages per turn (the two sides alternate)")
    ap.add_argument("--request-size", type=int, default=2048, help="inputs per engine request (OpenAI's maximum)")
    ap.add_argument("--max-batch-tokens", type=int, default=EmbeddingConfig.max_batch_tokens)
    ap.add_argument("--sweep", default="256,512,1024,2048,4096", help="max_batch_tokens values ('' to skip)")
    ap.add_argument("--sweep-passages", type=int, default=1000)
    ap.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    args = ap.parse_args()

    from sentence_transformers import SentenceTransformer

    engine = EmbeddingEngine(EmbeddingConfig(dtype=args.dtype, max_batch_tokens=args.max_batch_tokens))
    reference = SentenceTransformer(str(engine.model_path), device="cpu")
    texts = corpus(engine, args.passages)
    lengths = [len(ids) for ids in engine.tokenize(texts, truncate=True)]
    print(f"machine: {machine()}")
    print(f"model: {engine.model_name} (engine matmuls {str(engine.dtype).removeprefix('torch.')}, "
          f"max_batch_tokens {args.max_batch_tokens})")
    print(f"corpus: {len(texts)} passages, {min(lengths)}-{max(lengths)} tokens, mean {sum(lengths) / len(texts):.0f}")

    warm = texts[:64]
    reference.encode(warm, batch_size=32)
    run_engine(engine, warm, args.request_size)
    refs: list[Run] = []
    engs: list[Run] = []
    for k, start in enumerate(range(0, len(texts), args.slice)):
        part = texts[start:start + args.slice]
        if k % 2:
            engs.append(run_engine(engine, part, args.request_size))
        refs.append(run_reference(reference, part))
        if not k % 2:
            engs.append(run_engine(engine, part, args.request_size))
    ref, eng = Run.total(refs), Run.total(engs)
    n = len(texts)
    print(f"sentence-transformers encode(batch_size=32): {ref.rate(n)}")
    print(f"engine ({eng.steps} steps, {eng.seconds / eng.steps * 1e3:.0f} ms a step): {eng.rate(n)}")
    print(f"ratio engine / sentence-transformers: {ref.seconds / eng.seconds:.2f}x wall, "
          f"{ref.cpu_seconds / eng.cpu_seconds:.2f}x per CPU-second "
          f"(by slice, wall: {', '.join(f'{r.seconds / e.seconds:.2f}' for r, e in zip(refs, engs))})")
    cos = (eng.vectors * ref.vectors).sum(1)
    print(f"cosine to the reference: min {cos.min():.6f}, mean {cos.mean():.6f}")

    sweep = [int(v) for v in args.sweep.split(",") if v]
    if sweep:
        part = texts[:args.sweep_passages]
        idle = query_seconds(engine)
        print(f"max_batch_tokens sweep on {len(part)} passages (a one-line query alone: {idle * 1e3:.1f} ms; "
              "one arriving during a bulk request waits for the step under way, about half a step at p50):")
        for budget in sweep:
            engine.scheduler.max_batch_tokens = max(budget, engine.max_input_tokens)
            run_engine(engine, part[:32], args.request_size)
            e = run_engine(engine, part, args.request_size)
            step = e.seconds / e.steps
            print(f"  {budget:5d}: {e.rate(len(part))}, {e.steps} steps, {step * 1e3:6.1f} ms a step, "
                  f"query p50 under bulk ~{(step / 2 + idle) * 1e3:5.1f} ms ({(step / 2 + idle) / idle:.1f}x idle)")


def query_seconds(engine: EmbeddingEngine, repeats: int = 21) -> float:
    """Median time of one step that embeds a one-line query alone (what a query costs an idle engine)."""
    times = []
    for i in range(repeats):
        ids = engine.tokenize(["where can I find the annual report for last year?"])
        t = time.perf_counter()
        engine.add_request(EmbeddingRequest(f"query-{i}", ids, priority=0))
        engine.step()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


if __name__ == "__main__":
    main()
