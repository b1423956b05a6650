"""Sluice against llama.cpp on the same GGUF, both as OpenAI-compatible servers driven by the same client.

llama.cpp runs as `llama-cpp-python[server]` (n_threads=2, interrupt_requests=False) from its own
environment, built by `bench/setup_llamacpp.sh`; it is never a Sluice dependency. The servers run one
after the other (never together) on the same machine, with the same prompts, at concurrency 1 and 16.

    bash bench/setup_llamacpp.sh && python -m bench.vs_llamacpp [--requests 32] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
from pathlib import Path

from bench.common import mixed_workload, pct
from bench.load import run_load
from bench.server import ROOT, free_port, managed_server, sluice_server
from engine.loader import default_model_path

MODEL = "SmolLM2-135M-Instruct"


@contextlib.contextmanager
def llamacpp_server(env_dir: Path, threads: int = 2):
    port = free_port()
    cmd = [str(env_dir / "bin" / "python"), "-m", "llama_cpp.server", "--model", str(default_model_path()),
           "--model_alias", MODEL, "--n_threads", str(threads), "--n_ctx", "8192", "--interrupt_requests", "False",
           "--port", str(port)]
    with managed_server(cmd, f"http://127.0.0.1:{port}/v1/models", {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}):
        yield f"http://127.0.0.1:{port}/v1"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--min-tokens", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--llamacpp-env", default=str(ROOT / "bench" / ".venv-llamacpp"))
    a = ap.parse_args(argv)
    env_dir = Path(a.llamacpp_env)
    if not (env_dir / "bin" / "python").exists():
        raise SystemExit(f"{env_dir} is missing: run bash bench/setup_llamacpp.sh first")
    results = {}
    for name, ctx in (("llama.cpp", llamacpp_server(env_dir)), ("sluice", sluice_server())):
        with ctx as url:
            for c in (1, 16):
                n = a.requests if c > 1 else max(4, a.requests // 4)
                work = mixed_workload(n, a.min_tokens, a.max_tokens, seed=c)
                asyncio.run(run_load(url, MODEL, work[:2], 2))  # warm-up
                r = asyncio.run(run_load(url, MODEL, work, c))
                results[(name, c)] = r
                print(r.line(f"{name:9s}"), flush=True)
    for c in (1, 16):
        ref, s = results[("llama.cpp", c)], results[("sluice", c)]
        print(f"c={c:<2d} sluice/llama.cpp: output tokens/s {(s.output_tokens / s.wall) / (ref.output_tokens / ref.wall):5.2f}x   "
              f"TTFT p50 {pct(s.ttft, 50) / pct(ref.ttft, 50):6.3f}x (lower is better)")


if __name__ == "__main__":
    main()
