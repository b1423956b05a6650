"""A batch survives kill -9: a greedy chat batch runs on `sluice serve`, which is killed with SIGKILL when
about a third of the lines are done, then started again on the same directory; once the dead runner's
lease runs out the new one finishes the batch. Every line must be answered once, equal to the same
batch run without interruption (greedy: the same text).

With --redis, the distributed path: a throwaway redis-server, `sluice serve --no-engine` and one `sluice
worker` (and one for the embedding model, which the gateway also serves); the gateway is SIGKILLed at a third of the lines and started again, then the worker at two thirds
(its lines in flight go back to the queue when its lease runs out) and started again. Lines run 8 at a
time here, so both kills land mid-batch.

    python -m bench.batch_kill [--lines 96] [--max-tokens 24] [--redis]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import openai

from bench.common import TOPICS
from bench.server import free_port, managed_server
from bench.structured import cpu_model

ROOT = Path(__file__).resolve().parents[1]


def _lines(model: str, n: int, max_tokens: int) -> bytes:
    return "\n".join(json.dumps({"custom_id": f"l{i}", "method": "POST", "url": "/v1/chat/completions", "body": {
        "model": model, "max_tokens": max_tokens, "temperature": 0,
        "messages": [{"role": "user", "content": f"One fact about {TOPICS[i % len(TOPICS)]} (#{i})."}]}})
        for i in range(n)).encode()


def _wait(c: openai.OpenAI, bid: str, until: float) -> openai.types.Batch:
    while True:
        b = c.batches.retrieve(bid)
        if b.status in ("completed", "failed", "cancelled", "expired") or time.time() > until:
            return b
        time.sleep(0.2)


def _outputs(c: openai.OpenAI, b: openai.types.Batch) -> dict[str, str]:
    rows = [json.loads(x) for x in c.files.content(b.output_file_id).text.splitlines()]
    ids = [r["custom_id"] for r in rows]
    assert len(ids) == len(set(ids)), "a line was answered twice"
    return {r["custom_id"]: r["response"]["body"]["choices"][0]["message"]["content"] for r in rows}


def _uninterrupted(c: openai.OpenAI, args: argparse.Namespace) -> tuple[str, float, dict[str, str]]:
    """Uploads the lines and runs them once without trouble: (the file's id, seconds, outputs by custom_id)."""
    model = c.models.list().data[0].id
    f = c.files.create(file=("in.jsonl", _lines(model, args.lines, args.max_tokens)), purpose="batch")
    t0 = time.time()
    whole = _wait(c, c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                      completion_window="24h").id, time.time() + 1200)
    assert whole.status == "completed", whole
    return f.id, time.time() - t0, _outputs(c, whole)


def _until_done(c: openai.OpenAI, bid: str, n: int) -> int:
    while (c.batches.retrieve(bid).request_counts.completed or 0) < n:
        time.sleep(0.1)
    return c.batches.retrieve(bid).request_counts.completed


def redis_path(args: argparse.Namespace) -> None:
    if not shutil.which("redis-server"):
        sys.exit("redis-server not found")
    tmp = tempfile.mkdtemp(prefix="sluice-batch-kill-")
    rport, port = free_port(), free_port()
    redis = subprocess.Popen(["redis-server", "--port", str(rport), "--save", "", "--appendonly", "yes", "--dir",
                              tmp], stdout=subprocess.DEVNULL)
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "SLUICE_AUTH__KEYS_FILE": f"{tmp}/keys.json",
           "PYTHONPATH": str(ROOT), "SLUICE_REDIS_URL": f"redis://127.0.0.1:{rport}/0",
           "SLUICE_BATCHES__MAX_IN_FLIGHT": "8"}  # slower than the default 48: both kills land mid-batch
    env.pop("SLUICE_CONFIG", None)
    serve = [sys.executable, "-m", "gateway.cli", "serve", "--no-engine", "--port", str(port)]
    work = [sys.executable, "-m", "gateway.cli", "worker"]
    url = f"http://127.0.0.1:{port}"
    c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=3, timeout=600)
    worker = subprocess.Popen(work, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # the gateway is ready once every model it serves has a worker: the embedding model's too
    embedder = subprocess.Popen([*work, "--model", "all-MiniLM-L6-v2"], env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    try:
        with managed_server(serve, url + "/ready", env, cwd=ROOT) as gateway:
            file_id, uninterrupted, want = _uninterrupted(c, args)
            bid = c.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h").id
            t1 = time.time()
            at_gateway = _until_done(c, bid, args.lines // 3)
            os.kill(gateway.pid, signal.SIGKILL)
            gateway.wait()
        with managed_server(serve, url + "/ready", env, cwd=ROOT):
            at_worker = _until_done(c, bid, 2 * args.lines // 3)
            assert at_worker < args.lines, "the batch ended before the worker's kill"
            os.kill(worker.pid, signal.SIGKILL)
            worker.wait()
            worker = subprocess.Popen(work, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            b = _wait(c, bid, time.time() + 1200)
            got = _outputs(c, b)
    finally:
        worker.kill()
        embedder.kill()
        redis.kill()
    same = sum(got.get(k) == v for k, v in want.items())
    print(f"[redis] {args.lines} greedy lines of {args.max_tokens} tokens; uninterrupted run {uninterrupted:.1f} s")
    print(f"[redis] gateway SIGKILLed with {at_gateway} lines done and started again, worker SIGKILLed with "
          f"{at_worker} done and started again: finished {time.time() - t1:.1f} s after the batch began "
          f"(the dead runner's 30 s lease, the worker's 10 s queue lease and two starts included): status "
          f"{b.status}, {b.request_counts.completed} completed, {b.request_counts.failed} failed, {len(got)} output "
          f"lines, each once; {same}/{len(want)} equal to the uninterrupted run")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lines", type=int, default=96)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--redis", action="store_true", help="the distributed path (redis-server, gateway, worker)")
    args = ap.parse_args(argv)
    print(f"CPU: {cpu_model()}")
    if args.redis:
        redis_path(args)
        return
    tmp = tempfile.mkdtemp(prefix="sluice-batch-kill-")
    port = free_port()
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "SLUICE_AUTH__KEYS_FILE": f"{tmp}/keys.json",
           "PYTHONPATH": str(ROOT)}
    env.pop("SLUICE_CONFIG", None)
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--port", str(port)]
    url = f"http://127.0.0.1:{port}"
    c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=3, timeout=600)
    with managed_server(cmd, url + "/ready", env, cwd=ROOT) as proc:
        file_id, uninterrupted, want = _uninterrupted(c, args)
        bid = c.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h").id
        while (c.batches.retrieve(bid).request_counts.completed or 0) < args.lines // 3:
            time.sleep(0.1)
        before = c.batches.retrieve(bid).request_counts.completed
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    t1 = time.time()
    with managed_server(cmd, url + "/ready", env, cwd=ROOT):
        b = _wait(c, bid, time.time() + 1200)
        got = _outputs(c, b)
    same = sum(got.get(k) == v for k, v in want.items())
    print(f"{args.lines} greedy lines of {args.max_tokens} tokens; uninterrupted run {uninterrupted:.1f} s")
    print(f"killed (SIGKILL) with {before} lines done; restarted, finished in {time.time() - t1:.1f} s "
          f"(including the dead runner's 30 s lease): status {b.status}, {b.request_counts.completed} completed, "
          f"{b.request_counts.failed} failed, {len(got)} output lines, each once; "
          f"{same}/{len(want)} equal to the uninterrupted run")


if __name__ == "__main__":
    main()
