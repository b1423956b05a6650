"""The Responses store under load: 100,000 stored responses (about 2 KB of JSON each, 100 keys), then the
latency of `get` (p50/p99 over random ids of their owners) and the database's size against its cap;
then a writer process is killed with SIGKILL mid-stream and a fresh store on the same file counts every
response whose `put` had returned before the kill.

    python -m bench.responses_store [--responses 100000] [--cap-mb 1024]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.structured import cpu_model
from gateway.store.responses import ResponseStore

TEXT = "The pallet ships on Tuesday from the north dock; the container follows on Friday. " * 20


def _response(i: int) -> dict:
    return {"id": f"resp_{i:08d}", "object": "response", "created_at": time.time(), "status": "completed",
            "model": "SmolLM2-135M-Instruct", "output": [{"id": f"msg_{i}", "type": "message", "status": "completed",
                                                          "role": "assistant", "content": [{
                                                              "type": "output_text", "text": TEXT,
                                                              "annotations": [], "logprobs": []}]}],
            "usage": {"input_tokens": 40, "output_tokens": 400, "total_tokens": 440}}


async def fill_and_read(path: str, n: int, cap_mb: float) -> None:
    s = ResponseStore(path, max_bytes=int(cap_mb * 1e6))
    t0 = time.perf_counter()
    for i in range(n):
        await s.put(f"key{i % 100}", _response(i), [{"type": "message", "role": "user", "content": f"q{i}"}])
    fill = time.perf_counter() - t0
    rows, size = await s.stats()
    rng = random.Random(0)
    lat = []
    found = 0
    for _ in range(5000):
        i = rng.randrange(n - rows, n)  # ids still stored (the oldest were evicted past the cap)
        t = time.perf_counter()
        got = await s.get(f"key{i % 100}", f"resp_{i:08d}")
        lat.append(time.perf_counter() - t)
        found += got is not None
    await s.close()
    lat.sort()
    file_mb = sum(os.path.getsize(p) for p in Path(path).parent.glob(Path(path).name + "*")) / 1e6
    print(f"stored {n:,} responses in {fill:.1f} s ({n / fill:,.0f}/s); kept {rows:,} "
          f"({size / 1e6:.1f} MB of database in use, cap {cap_mb:.0f} MB; file with WAL {file_mb:.1f} MB)")
    print(f"get: p50 {lat[len(lat) // 2] * 1e3:.3f} ms, p99 {lat[int(len(lat) * 0.99)] * 1e3:.3f} ms "
          f"over 5,000 reads ({found:,} found)")


WRITER = """
import asyncio, sys, time
sys.path.insert(0, {root!r})
from gateway.store.responses import ResponseStore
from bench.responses_store import _response
async def main():
    s = ResponseStore({path!r})
    i = 0
    while True:
        await s.put("k", _response(i), [])
        print(i, flush=True)  # after put returned: committed
        i += 1
asyncio.run(main())
"""


async def kill_and_recount(path: str) -> None:
    root = str(Path(__file__).resolve().parents[1])
    proc = subprocess.Popen([sys.executable, "-c", WRITER.format(root=root, path=path)], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None
    last = -1
    deadline = time.time() + 3
    while time.time() < deadline:
        line = proc.stdout.readline()
        if line:
            last = int(line)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    s = ResponseStore(path)
    missing = [i for i in range(last + 1) if await s.get("k", f"resp_{i:08d}") is None]
    await s.close()
    print(f"kill -9 after {last + 1:,} acknowledged writes: {len(missing)} missing after restart")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--responses", type=int, default=100_000)
    ap.add_argument("--cap-mb", type=float, default=1024.0)  # (the default store cap)
    args = ap.parse_args(argv)
    print(f"CPU: {cpu_model()}")
    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(fill_and_read(str(Path(tmp) / "fill.sqlite3"), args.responses, args.cap_mb))
        asyncio.run(kill_and_recount(str(Path(tmp) / "kill.sqlite3")))


if __name__ == "__main__":
    main()
