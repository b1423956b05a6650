"""A replica SIGKILLed under concurrent streams, with real engines: two replicas of one kind (`sluice serve`
processes, or llama.cpp's `llama-server`) behind a gateway that serves from its engine pool alone.

Each prompt is first answered alone, directly by a replica (greedy, uninterrupted: the reference). Then
`--streams` greedy streams go through the gateway at once, twice: a control run with no trouble, and a run
in which replica b is SIGKILLed once every stream has its first text. A stream on b is continued on a from
the text relayed so far (vLLM's `continue_final_message` for Sluice, a final assistant message for
llama-server). Counted per run: streams that completed (no error event, the connection whole), answers equal
to the reference, and answers that repeat text (the reference's text followed by more of it). An engine
whose greedy answers change with the batch (llama-server's do: its float sums depend on the batch) shows
that in the control run too; the kill run is read against the control. Sluice replicas run the int16
native step at every batch size (`wide_min_rows = 0`): its answers do not depend on the batch, where the
wide matmul of large steps (AMX tiles, or int8 activations) rounds differently from the one-request
reference (with AMX, one answer of 32 differed).

    python -m bench.pool_kill [--kind sluice|llama-server] [--streams 32] [--max-tokens 48]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import aiohttp
from aiohttp.test_utils import TestServer

from bench.common import TOPICS
from bench.server import free_port, wait_ready
from bench.structured import cpu_model

ROOT = Path(__file__).resolve().parents[1]
MODEL = "SmolLM2-135M-Instruct"
LLAMA_SERVER = ROOT / "bench" / ".llama-server" / "build" / "bin" / "llama-server"


@contextlib.contextmanager
def replica(kind: str, tmp: Path, name: str, admin_keys: Path, slots: int) -> Iterator[tuple[str, subprocess.Popen]]:
    """One replica process: (base URL without /v1, the process). Killed at the end if still running."""
    from engine.loader import default_model_path

    port = free_port()
    log = open(tmp / f"{name}.log", "w")
    if kind == "sluice":
        env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": str(ROOT),
               "SLUICE_AUTH__KEYS_FILE": str(admin_keys), "OMP_NUM_THREADS": "1",
               "SLUICE_ENGINE__KV_CACHE_TOKENS": "32768", "SLUICE_ENGINE__WIDE_MIN_ROWS": "0", "SLUICE_ENGINE__MAX_RUNNING_REQUESTS": str(slots)}
        env.pop("SLUICE_CONFIG", None)
        (tmp / "replica.toml").write_text('[[models]]\nkind = "chat"\n')
        env["SLUICE_CONFIG"] = str(tmp / "replica.toml")
        cmd = [sys.executable, "-m", "gateway.cli", "serve", "--port", str(port)]
        ready = f"http://127.0.0.1:{port}/ready"
    else:
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
        cmd = [str(LLAMA_SERVER), "-m", str(default_model_path()), "--alias", MODEL, "-t", "1", "-np", str(slots),
               "-c", str(slots * 1024), "--no-repack", "--metrics", "--jinja", "--host", "127.0.0.1",
               "--port", str(port)]
        ready = f"http://127.0.0.1:{port}/v1/models"
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_ready(ready, proc=proc)
        yield f"http://127.0.0.1:{port}", proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(20)


async def stream(s: aiohttp.ClientSession, base: str, prompt: str, n: int,
                 first: asyncio.Event | None = None) -> tuple[str, str, bool]:
    """(the backend header, the text, completed: ended with a finish reason and no error event)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": n, "temperature": 0,
            "stream": True}
    text, ok = [], False
    async with s.post(base + "/v1/chat/completions", json=body) as r:
        if r.status != 200:
            return "", await r.text(), False
        backend = r.headers.get("x-sluice-backend", "")
        try:
            async for line in r.content:
                line = line.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return backend, "".join(text), False
                for c in chunk.get("choices") or []:
                    text.append((c.get("delta") or {}).get("content") or "")
                    ok = ok or bool(c.get("finish_reason"))
                if first is not None and "".join(text):
                    first.set()
        except aiohttp.ClientError:
            return backend, "".join(text), False
    return backend, "".join(text), ok


def _repeats(text: str, ref: str) -> bool:
    """Text relayed twice at the switch: the answer is longer than the reference and holds a repeated span."""
    if len(text) <= len(ref):
        return False
    return any(text[i:i + 12] in text[i + 12:] and text[i:i + 12] not in ref[i + 12:]
               for i in range(0, len(text) - 24))


async def run(args: argparse.Namespace) -> None:
    from gateway.admission.keys import KeyStore
    from gateway.http.app import create_app
    from gateway.settings import Settings

    tmp = Path(tempfile.mkdtemp(prefix="sluice-pool-kill-"))
    keys = KeyStore(tmp / "replica-keys.json")
    os.environ["SLUICE_BENCH_POOL_KEY"] = keys.create("pool", "pro", admin=True)
    prompts = [f"Write two sentences about {TOPICS[i % len(TOPICS)]}." for i in range(args.streams)]
    with replica(args.kind, tmp, "a", tmp / "replica-keys.json", args.streams) as (a, _), \
            replica(args.kind, tmp, "b", tmp / "replica-keys.json", args.streams) as (b, proc_b):
        def engine(name: str, base: str) -> dict:
            return {"name": name, "base_url": base + "/v1", "kind": args.kind, "models": [MODEL],
                    "api_key_env": "SLUICE_BENCH_POOL_KEY", "max_in_flight": args.streams}
        settings = Settings(auth={"keys_file": str(tmp / "keys.json")}, server={"prepare_helper_at_start": False},
                            engines=[engine("a", a), engine("b", b)],
                            # No overflow: with no provider a request past its tier's target would get an
                            # early 429 (SLO admission); here every stream waits for room instead.
                            routing={"breaker_failures": 2, "breaker_cooldown_s": 1.0, "overflow": False})
        app = create_app(settings, keys=KeyStore(tmp / "keys.json"), no_engine=True)
        server = TestServer(app, host="127.0.0.1")
        await server.start_server()
        gw = f"http://127.0.0.1:{server.port}"
        headers = {"Authorization": f"Bearer {os.environ['SLUICE_BENCH_POOL_KEY']}"}
        rows = []
        try:
            # A new connection a request: llama-server closes kept-alive ones that aiohttp would reuse.
            async with aiohttp.ClientSession(headers=headers, connector=aiohttp.TCPConnector(force_close=True)) as direct:
                ref = {}
                for p in dict.fromkeys(prompts):
                    ref[p] = (await stream(direct, a, p, args.max_tokens))[1]
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
                for label, kill in (("control (no kill)", False), ("replica b SIGKILLed", True)):
                    firsts = [asyncio.Event() for _ in prompts]
                    tasks = [asyncio.create_task(stream(s, gw, p, args.max_tokens, f)) for p, f in zip(prompts, firsts)]
                    if kill:
                        await asyncio.wait_for(asyncio.gather(*(f.wait() for f in firsts)), 300)
                        proc_b.send_signal(signal.SIGKILL)
                    results = await asyncio.gather(*tasks)
                    for p, (bk, t, ok) in zip(prompts, results):
                        if not ok or t != ref[p]:
                            print(f"  {label}: {bk} completed={ok} got {t!r} want {ref[p]!r}", file=sys.stderr)
                    on_b = sum(1 for bk, _, _ in results if bk == "engine:b")
                    done = sum(1 for _, _, ok in results if ok)
                    equal = sum(1 for p, (_, t, _) in zip(prompts, results) if t == ref[p])
                    repeated = sum(1 for p, (_, t, _) in zip(prompts, results) if _repeats(t, ref[p]))
                    rows.append((label, len(prompts), on_b, done, equal, repeated))
        finally:
            await server.close()
    print(f"bench.pool_kill: {args.kind} replicas, {args.streams} concurrent greedy streams of {args.max_tokens} "
          f"tokens; CPU: {cpu_model()}, {os.cpu_count()} cores")
    print(f"{'run':<22} {'streams':>7} {'began on b':>10} {'completed':>9} {'= reference':>11} {'repeated':>8}")
    for label, n, on_b, done, equal, repeated in rows:
        print(f"{label:<22} {n:>7} {on_b:>10} {done:>9} {equal:>11} {repeated:>8}")
    print(f"logs: {tmp}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kind", choices=("sluice", "llama-server"), default="sluice")
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args(argv)
    if args.kind == "llama-server" and not LLAMA_SERVER.exists():
        sys.exit(f"{LLAMA_SERVER} is missing: run bench/setup_llama_server.sh first (~25 min)")
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
