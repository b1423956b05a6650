"""Sluice against llama.cpp's own C++ `llama-server` on the same GGUF, driven by the same client.

Streamed greedy chat (temperature 0, `max_tokens` 96 by default) through the OpenAI SDK at concurrency
1, 4, 16 and 64. Both servers run at once but are loaded in turn, in alternating rounds (A B, then B A,
...), so slow drift of a shared machine hits both; each round sends new prompts (the same ones to
both servers). llama-server gets `-t 2 -np <concurrency>`, `--no-repack` on AMX CPUs only (its
repacked AMX path crashes at load there; elsewhere it keeps its repacked weights, as its users get it;
`--llama-repack on` keeps them for a build without AMX code, e.g. an AVX2-only one run on an AMX CPU),
and `-c` = slots x context per slot; it is restarted per concurrency. It runs with llama.cpp's own
OpenMP default (threads spin between graph nodes; Sluice's `OMP_WAIT_POLICY` and `GOMP_SPINCOUNT` are
removed from its environment), which is what its users get; `--llama-omp default,PASSIVE` adds a row
for it with sleeping threads as well. Sluice runs `sluice serve` at its default configuration but for
the models it serves (the chat model alone, as llama-server: no embedding model beside it), started
once. Printed: output tok/s, TTFT p50/p99, the ratios, and each server process's peak RSS (VmHWM from
/proc).

llama-cpp-python's Python server is a further row only if `bench/.venv-llamacpp` exists
(`bash bench/setup_llamacpp.sh`, about 25 minutes of CPU to build).

    bash bench/setup_llama_server.sh && python -m bench.vs_llamacpp [--rounds 2] [--levels 1,4,16,64]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

from bench.common import machine, mixed_workload, pct
from bench.load import LoadResult, run_load
from bench.server import ROOT, free_port, managed_server, sluice_server_process
from engine.loader import default_model_path
from kernels.cpu import build as cpu_build
from kernels.cpu.cpuinfo import cpu_info

MODEL = "SmolLM2-135M-Instruct"


def has_amx() -> bool:
    """llama.cpp's repacked AMX path crashes at load on AMX CPUs: there (only) llama-server gets --no-repack;
    elsewhere it runs as its users get it, with its repacked (interleaved) weights."""
    return "amx_tile" in cpu_info().flags


def peak_rss_mb(pid: int) -> tuple[float, float]:
    """(current, peak) resident memory of a process in MiB (VmRSS, VmHWM)."""
    vals = {}
    with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "VmHWM"):
                vals[k] = int(v.split()[0]) / 1024
    return vals.get("VmRSS", float("nan")), vals.get("VmHWM", float("nan"))


@contextlib.contextmanager
def llama_server(binary: Path, slots: int, ctx_per_slot: int, threads: int = 2,
                 omp_wait_policy: str | None = None, model: Path | None = None,
                 repack: bool | None = None) -> Iterator[tuple[str, int]]:
    """omp_wait_policy None: llama.cpp's own default (its OpenMP threads spin between graph nodes),
    what a user who starts llama-server gets. repack None: off on AMX CPUs only (has_amx)."""
    repack = not has_amx() if repack is None else repack
    port = free_port()
    cmd = [str(binary), "-m", str(model or default_model_path()), "--alias", MODEL, "-t", str(threads), "-np", str(slots),
           "-c", str(slots * ctx_per_slot), *([] if repack else ["--no-repack"]), "--host", "127.0.0.1",
           "--port", str(port)]
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    if omp_wait_policy:
        env["OMP_WAIT_POLICY"] = omp_wait_policy
    with managed_server(cmd, f"http://127.0.0.1:{port}/v1/models", env) as proc:
        yield f"http://127.0.0.1:{port}/v1", proc.pid


@contextlib.contextmanager
def llamacpp_python_server(env_dir: Path, threads: int = 2, model: Path | None = None) -> Iterator[tuple[str, int]]:
    """llama-cpp-python's server with repacking off (bench/llamacpp_norepack.py: the AMX repack crashes it
    at the first request) and llama.cpp's own OpenMP default, as llama-server's main row."""
    port = free_port()
    cmd = [str(env_dir / "bin" / "python"), str(ROOT / "bench" / "llamacpp_norepack.py"), "--model",
           str(model or default_model_path()), "--model_alias", MODEL, "--n_threads", str(threads), "--n_ctx", "8192",
           "--interrupt_requests", "False", "--port", str(port)]
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    with managed_server(cmd, f"http://127.0.0.1:{port}/v1/models", env) as p:
        yield f"http://127.0.0.1:{port}/v1", p.pid


def requests_for(c: int, scale: float) -> int:
    return max(4, round({1: 6, 4: 16, 16: 48, 64: 128}.get(c, 2 * c) * scale))


def merge(results: list[LoadResult]) -> LoadResult:
    return LoadResult(results[0].concurrency, sum(r.requests for r in results), sum(r.wall for r in results),
                      [t for r in results for t in r.ttft], [x for r in results for x in r.latency],
                      sum(r.output_tokens for r in results), sum(r.errors for r in results))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--levels", default="1,4,16,64")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds per level (A B, B A, ...)")
    ap.add_argument("--scale", type=float, default=1.0, help="multiplies the requests per round")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--ctx-per-slot", type=int, default=1024)
    ap.add_argument("--llama-omp", default="default",
                    help="llama-server variants by OMP_WAIT_POLICY, comma-separated: default (unset: llama.cpp's "
                         "own spinning threads, what its users get), PASSIVE, ACTIVE")
    ap.add_argument("--llama-server", default=str(ROOT / "bench" / ".llama-server" / "build" / "bin" / "llama-server"))
    ap.add_argument("--llama-repack", choices=("auto", "on", "off"), default="auto",
                    help="llama-server's repacked weights: auto (off on AMX CPUs, where its repacked AMX path "
                         "crashes; on elsewhere), on (e.g. an AVX2-only build on an AMX CPU), off")
    ap.add_argument("--llamacpp-env", default=str(ROOT / "bench" / ".venv-llamacpp"))
    ap.add_argument("--model", default=None,
                    help="a GGUF file both servers load (default: the packaged SmolLM2 Q4_1; e.g. one requantised "
                         "by llama-quantize)")
    ap.add_argument("--sluice-engine", default="{}",
                    help='EngineConfig keys for Sluice\'s model, as JSON (e.g. \'{"wide_min_rows": 0}\': int16 matmuls '
                         'at every batch size)')
    a = ap.parse_args(argv)
    binary = Path(a.llama_server)
    if not binary.exists():
        raise SystemExit(f"{binary} is missing: run bash bench/setup_llama_server.sh first")
    levels = [int(x) for x in a.levels.split(",")]
    variants = [v.strip() for v in a.llama_omp.split(",")]
    if not set(variants) <= {"default", "PASSIVE", "ACTIVE"}:
        raise SystemExit("--llama-omp takes default, PASSIVE and/or ACTIVE")
    llama_names = {v: "llama-server" if v == "default" else f"llama {v}" for v in variants}
    py_env = Path(a.llamacpp_env)
    model = Path(a.model) if a.model else None
    print(f"machine: {machine()}; model {model or default_model_path()}", flush=True)
    if not (py_env / "bin" / "python").exists():
        print(f"(llama-cpp-python's server: skipped, {py_env} does not exist; bash bench/setup_llamacpp.sh)")
    results: dict[tuple[str, int], list[LoadResult]] = {}
    rss: dict[tuple[str, int], tuple[float, float]] = {}

    def load(name: str, url: str, c: int, rnd: int) -> None:
        work = mixed_workload(requests_for(c, a.scale), a.max_tokens, a.max_tokens, seed=1000 * c + rnd)
        r = asyncio.run(run_load(url, MODEL, work, c))
        results.setdefault((name, c), []).append(r)
        print(r.line(f"  round {rnd} {name:12s}"), flush=True)

    # The chat model alone, as llama-server serves it (the default configuration adds an embedding model).
    only_chat = {"SLUICE_MODELS": json.dumps([{"id": MODEL, "path": None if model is None else str(model),
                                               "engine": json.loads(a.sluice_engine)}])}
    with sluice_server_process(only_chat) as (sluice_url, sluice_proc):
        asyncio.run(run_load(sluice_url, MODEL, mixed_workload(2, 8, 8, seed=-1), 2))  # warm-up
        for c in levels:
            with contextlib.ExitStack() as stack:
                servers, pids = [], {}
                for policy in variants:
                    name = llama_names[policy]
                    url, pids[name] = stack.enter_context(llama_server(
                        binary, c, a.ctx_per_slot, omp_wait_policy=None if policy == "default" else policy,
                        model=model, repack=None if a.llama_repack == "auto" else a.llama_repack == "on"))
                    asyncio.run(run_load(url, MODEL, mixed_workload(2, 8, 8, seed=-1), 2))
                    servers.append((name, url))
                servers.append(("sluice", sluice_url))
                for rnd in range(a.rounds):
                    for name, url in servers if rnd % 2 == 0 else servers[::-1]:
                        load(name, url, c, rnd)
                for name, pid in pids.items():
                    rss[(name, c)] = peak_rss_mb(pid)
            rss[("sluice", c)] = peak_rss_mb(sluice_proc.pid)
        if (py_env / "bin" / "python").exists():
            with llamacpp_python_server(py_env, model=model) as (py_url, py_pid):
                for c in levels:
                    for rnd in range(a.rounds):
                        load("llama-cpp-py", py_url, c, rnd)
                    rss[("llama-cpp-py", c)] = peak_rss_mb(py_pid)

    print(f"\nmachine: {machine()}; model {model or default_model_path()}")
    print(f"Sluice's native step built with {' '.join(cpu_build.target_flags())} (SLUICE_NATIVE_MARCH)")
    print(f"streamed greedy chat, max_tokens {a.max_tokens}, {a.rounds} alternating rounds per level\n")
    print("| c | server | out tok/s | TTFT p50 ms | TTFT p99 ms | peak RSS MiB | Sluice / it: tok/s | TTFT p50 |")
    print("|---|---|---|---|---|---|---|---|")
    for c in levels:
        s = merge(results[("sluice", c)])
        for name in (*llama_names.values(), "llama-cpp-py", "sluice"):
            if (name, c) not in results:
                continue
            r = merge(results[(name, c)])
            tps, s_tps = r.output_tokens / r.wall, s.output_tokens / s.wall
            if name == "sluice":
                ratio = ""
            elif tps == 0 or not r.ttft:  # every request failed
                ratio = "n/a | n/a"
            else:
                ratio = f"{s_tps / tps:.2f}x | {pct(s.ttft, 50) / pct(r.ttft, 50):.2f}x"
            print(f"| {c} | {name} | {tps:.1f} | {pct(r.ttft, 50) * 1000:.0f} | {pct(r.ttft, 99) * 1000:.0f} | "
                  f"{rss[(name, c)][1]:.0f} | {ratio or '- | -'} |" + (f" errors {r.errors}" if r.errors else ""))


if __name__ == "__main__":
    main()
