"""Embedding throughput: the encoder engine against sentence-transformers in this process, and the Sluice
gateway against llama.cpp's `llama-server --embeddings` over HTTP, on the same texts.

A synthetic corpus of `--passages` passages (lengths uniform in 20-250 tokens, [CLS]/[SEP] included;
sentences of the model vocabulary's whole words) is embedded four ways:

* sentence-transformers' `encode(batch_size=32, normalize_embeddings=True)`, in this process;
* `EmbeddingEngine` in this process (tokenizing included: requests of `--request-size` inputs, stepped
  to the end, vectors out as lists, as a worker would);
* llama.cpp's C++ `llama-server --embeddings --pooling mean` (MiniLM is mean-pooled; the server
  normalises, the norms are printed) on a GGUF that the vendored llama.cpp's convert_hf_to_gguf.py
  makes from the same folder into a temp dir at start (`--llama-outtype`, default f16; the engine's
  dtype is printed: bfloat16 on CPUs with AVX512-BF16 or AMX, else float32; `bf16` gives llama.cpp
  the same), `-t` the cores, `-np --llama-parallel` slots of 512 tokens (the model's maximum), -b = -ub
  = 512 x slots. Each input of a request is a task of its own; the ready slots' inputs share one
  forward, which must fit one ubatch (the attention is not causal). Fewer, smaller forwards were
  faster (2 shared vCPUs, alternating rounds): -np 1-4 within ~10%, -np 2 the best, 8 -7%, 16 -35% (the
  attention runs over the whole ubatch, masked). llama.cpp's own OpenMP default (threads spin between
  nodes) unless `--llama-omp`: PASSIVE was as fast on a quiet machine, much faster under others' load.
  Missing binary (bash bench/setup_llama_server.sh builds it): said, and this part skipped;
* `sluice serve` (bench/server.py) with all-MiniLM-L6-v2 alone, at the in-process engine's dtype and
  `--max-batch-tokens`.
The two servers get the same client: POST /v1/embeddings, `--http-request-size` inputs a request (64),
`--concurrency` requests in flight (2), `encoding_format` float, keep-alive, vectors parsed. Both stay
up; only the one measured is loaded.

On a shared machine wall-clock rates swing with other processes' load, so the sides take turns on
slices of `--slice` passages (which one goes first alternates: the in-process pair, then the HTTP pair)
and each side's times add up over the slices: all see the same load. (sentence-transformers sorts by
length within each encode call: in a slice of 1,000 passages its batches of 32 span ~7 tokens, ~3%
padding, against ~1.5% sorting 2,000.) The rate per CPU-second is printed too: of this process (all its
threads) in-process, of the server's process tree over HTTP (the client's excluded). It counts only
the work done, and its ratio is the steadier one. A table ends it: inputs/s of the four, and the ratios
engine / sentence-transformers, Sluice gateway / llama-server, gateway / in-process engine.

The vectors are checked: the engine's against the reference (min and mean cosine over the corpus),
each server's against the engine and the reference, and the prompt tokens each server counted against
the engine's tokenizer. Then `max_batch_tokens` is swept on the first `--sweep-passages` passages:
inputs/s, and the mean step time, which is what sets a query's latency under a bulk request (a step
cannot be interrupted: a query arriving during one waits for it, then runs in a step of its own).

    python -m bench.embeddings [--passages 10000] [--slice 1000] [--max-batch-tokens 1024]
                               [--sweep 256,512,1024,2048,4096] [--sweep-passages 1000] [--dtype auto]
                               [--http-request-size 64] [--concurrency 2] [--no-http] [--no-llama]
                               [--llama-server PATH] [--llama-outtype f16|f32|bf16] [--llama-parallel 2]
                               [--llama-ubatch 0] [--llama-omp default|PASSIVE|ACTIVE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

from bench.common import machine
from bench.embeddings_llamacpp import (
    LLAMA_CPP,
    LLAMA_SERVER,
    MODEL,
    EmbeddingsClient,
    convert_gguf,
    cores,
    llama_server,
    sluice_embedding_server,
    temp_dir,
)
from engine import EmbeddingConfig, EmbeddingEngine, EmbeddingRequest

LLAMA, SLUICE = "llama-server", "Sluice gateway"
LLAMA_PARALLEL = 2  # llama-server -np: 1-4 within ~10% of each other here, 2 the best; 8 -7%, 16 -35%


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


def http_run(r) -> Run:
    """A bench.embeddings_llamacpp.HttpResult as a Run: CPU seconds are the server's (its process tree),
    `steps` holds the prompt tokens the server counted."""
    return Run(r.seconds, r.server_cpu_seconds, torch.tensor(r.vectors), r.prompt_tokens)


def cosine_line(name: str, a: torch.Tensor, b: torch.Tensor) -> str:
    cos = torch.nn.functional.normalize(a, dim=1).mul(torch.nn.functional.normalize(b, dim=1)).sum(1)
    return f"cosine {name}: min {cos.min():.6f}, mean {cos.mean():.6f}"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--passages", type=int, default=10_000)
    ap.add_argument("--slice", type=int, default=1000, help="passages per turn (the sides alternate)")
    ap.add_argument("--request-size", type=int, default=2048,
                    help="inputs per request of the in-process engine (OpenAI's maximum)")
    ap.add_argument("--max-batch-tokens", type=int, default=EmbeddingConfig.max_batch_tokens)
    ap.add_argument("--sweep", default="256,512,1024,2048,4096", help="max_batch_tokens values ('' to skip)")
    ap.add_argument("--sweep-passages", type=int, default=1000)
    ap.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    ap.add_argument("--http-request-size", type=int, default=64, help="inputs per HTTP request (both servers)")
    ap.add_argument("--concurrency", type=int, default=2, help="HTTP requests in flight at once (both servers)")
    ap.add_argument("--no-http", action="store_true", help="in-process comparison only (no server started)")
    ap.add_argument("--no-llama", action="store_true", help="no llama-server (the Sluice HTTP row stays)")
    ap.add_argument("--llama-server", default=str(LLAMA_SERVER), help="the llama-server binary")
    ap.add_argument("--llama-outtype", default="f16", choices=("f16", "f32", "bf16"),
                    help="convert_hf_to_gguf.py --outtype of the GGUF llama-server runs")
    ap.add_argument("--llama-parallel", type=int, default=LLAMA_PARALLEL, help="llama-server -np (slots)")
    ap.add_argument("--llama-ubatch", type=int, default=0,
                    help="llama-server -b/-ub; 0: 512 tokens per slot (room for every slot's input)")
    ap.add_argument("--llama-omp", default="default", choices=("default", "PASSIVE", "ACTIVE"),
                    help="llama-server's OMP_WAIT_POLICY (default: unset, llama.cpp's own default)")
    args = ap.parse_args(argv)

    from sentence_transformers import SentenceTransformer

    engine = EmbeddingEngine(EmbeddingConfig(dtype=args.dtype, max_batch_tokens=args.max_batch_tokens))
    reference = SentenceTransformer(str(engine.model_path), device="cpu")
    texts = corpus(engine, args.passages)
    lengths = [len(ids) for ids in engine.tokenize(texts, truncate=True)]
    dtype = str(engine.dtype).removeprefix("torch.")
    print(f"machine: {machine()}; torch threads {torch.get_num_threads()}")
    print(f"model: {engine.model_name} (engine matmuls {dtype}, max_batch_tokens {args.max_batch_tokens})")
    print(f"corpus: {len(texts)} passages, {min(lengths)}-{max(lengths)} tokens, mean {sum(lengths) / len(texts):.0f}"
          f", {sum(lengths)} in all")

    with contextlib.ExitStack() as stack:
        servers = {} if args.no_http else start_servers(stack, args, engine, dtype)
        warm = texts[:64]
        reference.encode(warm, batch_size=32)
        run_engine(engine, warm, args.request_size)
        for client in servers.values():
            client.run(warm)
        refs: list[Run] = []
        engs: list[Run] = []
        https: dict[str, list[Run]] = {name: [] for name in servers}
        names = list(servers)
        for k, start in enumerate(range(0, len(texts), args.slice)):
            part = texts[start:start + args.slice]
            if k % 2:
                engs.append(run_engine(engine, part, args.request_size))
            refs.append(run_reference(reference, part))
            if not k % 2:
                engs.append(run_engine(engine, part, args.request_size))
            for name in (names[::-1] if k % 2 else names):
                https[name].append(http_run(servers[name].run(part)))
    ref, eng = Run.total(refs), Run.total(engs)
    http = {name: Run.total(runs) for name, runs in https.items()}
    n = len(texts)
    print(f"sentence-transformers encode(batch_size=32): {ref.rate(n)}")
    print(f"engine ({eng.steps} steps, {eng.seconds / eng.steps * 1e3:.0f} ms a step): {eng.rate(n)}")
    print(f"ratio engine / sentence-transformers: {ref.seconds / eng.seconds:.2f}x wall, "
          f"{ref.cpu_seconds / eng.cpu_seconds:.2f}x per CPU-second "
          f"(by slice, wall: {', '.join(f'{r.seconds / e.seconds:.2f}' for r, e in zip(refs, engs))})")
    cos = (eng.vectors * ref.vectors).sum(1)
    print(f"cosine to the reference: min {cos.min():.6f}, mean {cos.mean():.6f}")
    for name, run in http.items():
        norms = run.vectors.norm(dim=1)
        print(f"{name}: {run.rate(n).replace('CPU-second', 'server CPU-second')}; {run.steps} prompt tokens "
              f"counted (engine: {sum(lengths)}); vector norms {norms.min():.6f}-{norms.max():.6f}")
        print(f"  {cosine_line('to the engine', run.vectors, eng.vectors)}; "
              f"{cosine_line('to sentence-transformers', run.vectors, ref.vectors)}")
    if LLAMA in http and SLUICE in http:
        lr, sr = https[LLAMA], https[SLUICE]
        print("ratio Sluice / llama-server over HTTP by slice, wall: "
              + ", ".join(f"{a.seconds / b.seconds:.2f}" for a, b in zip(lr, sr)))
    print_table(n, ref, eng, http, args)

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


def start_servers(stack: contextlib.ExitStack, args: argparse.Namespace, engine: EmbeddingEngine,
                  dtype: str) -> dict[str, EmbeddingsClient]:
    """The Sluice gateway and (unless skipped or not built) llama-server, each with a client; both stay up
    (only the one being measured is loaded)."""
    loop = asyncio.new_event_loop()
    stack.callback(loop.close)
    clients: dict[str, EmbeddingsClient] = {}
    binary = Path(args.llama_server)
    threads = cores()
    if args.no_llama:
        print("llama-server: skipped (--no-llama)")
    elif not (binary.is_file() and os.access(binary, os.X_OK)):
        print(f"llama-server: skipped, {binary} is missing (bash bench/setup_llama_server.sh builds it)")
    elif not (LLAMA_CPP / "convert_hf_to_gguf.py").is_file():
        print(f"llama-server: skipped, {LLAMA_CPP / 'convert_hf_to_gguf.py'} is missing (the vendored llama.cpp "
              "that bash bench/setup_llama_server.sh unpacks)")
    else:
        gguf_dir = Path(stack.enter_context(temp_dir()))
        gguf, seconds = convert_gguf(engine.model_path, args.llama_outtype, gguf_dir)
        ubatch = args.llama_ubatch or 512 * args.llama_parallel
        url, pid = stack.enter_context(llama_server(binary, gguf, threads, args.llama_parallel, ubatch,
                                                    None if args.llama_omp == "default" else args.llama_omp))
        print(f"llama-server: {gguf.name} ({gguf.stat().st_size / 2**20:.1f} MiB, converted in {seconds:.1f} s), "
              f"--embeddings --pooling mean -t {threads} -np {args.llama_parallel} -b/-ub {ubatch} "
              f"-c {512 * args.llama_parallel}, OMP_WAIT_POLICY {args.llama_omp}")
        clients[LLAMA] = EmbeddingsClient(loop, url, pid, args.http_request_size, args.concurrency)
        stack.callback(clients[LLAMA].close)
    url, pid = stack.enter_context(sluice_embedding_server(dtype, args.max_batch_tokens))
    print(f"Sluice gateway: sluice serve with {MODEL} alone (dtype {dtype}, max_batch_tokens "
          f"{args.max_batch_tokens})")
    clients[SLUICE] = EmbeddingsClient(loop, url, pid, args.http_request_size, args.concurrency)
    stack.callback(clients[SLUICE].close)
    print(f"HTTP: POST /v1/embeddings, {args.http_request_size} inputs a request, {args.concurrency} in flight, "
          "encoding_format float")
    return clients


def print_table(n: int, ref: Run, eng: Run, http: dict[str, Run], args: argparse.Namespace) -> None:
    rows = [("sentence-transformers, in-process", ref, "process"), ("Sluice engine, in-process", eng, "process")]
    if LLAMA in http:
        rows.append((f"llama-server {args.llama_outtype}, HTTP", http[LLAMA], "server"))
    if SLUICE in http:
        rows.append(("Sluice gateway, HTTP", http[SLUICE], "server"))
    print(f"\n| side | inputs/s | inputs per CPU-second | seconds ({n} inputs) |")
    print("|---|---|---|---|")
    for name, run, whose in rows:
        print(f"| {name} | {n / run.seconds:.1f} | {n / run.cpu_seconds:.1f} ({whose}) | {run.seconds:.2f} |")
    ratios = [("Sluice engine / sentence-transformers (in-process)", ref, eng)]
    if LLAMA in http and SLUICE in http:
        ratios.append(("Sluice gateway / llama-server (HTTP)", http[LLAMA], http[SLUICE]))
    if SLUICE in http:
        ratios.append(("Sluice gateway (HTTP) / Sluice engine (in-process)", eng, http[SLUICE]))
    print("\n| ratio | wall | per CPU-second |")
    print("|---|---|---|")
    for name, base, run in ratios:
        print(f"| {name} | {base.seconds / run.seconds:.2f}x | {base.cpu_seconds / run.cpu_seconds:.2f}x |")
    print()


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
