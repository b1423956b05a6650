"""Real servers for the tests, one per session where they are fixtures: `sluice serve` with the real
model (`real_gateway`) and a redis-server (`redis_server`). tests/conftest.py registers the fixtures at the
top of the tree so every folder shares the same instances."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from bench.server import free_port, wait_ready

ROOT = Path(__file__).resolve().parents[1]


def wait_http_ok(url: str, proc: subprocess.Popen, log_path: Path, timeout: float = 300) -> None:
    """Returns once `url` answers 200; raises with the end of the server's log if it exits or times out."""
    try:
        wait_ready(url, timeout, proc)
    except (RuntimeError, TimeoutError) as e:
        raise RuntimeError(f"{e}:\n{log_path.read_text()[-3000:]}") from None


class RealGateway:
    def __init__(self, base: str, key: str, keys_file: Path, proc: subprocess.Popen, log_path: Path):
        self.base = base
        self.key = key
        self.keys_file = keys_file
        self.proc = proc
        self.log_path = log_path

    def ready(self) -> dict:
        try:
            with urllib.request.urlopen(self.base + "/ready", timeout=5) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            return json.loads(e.read())


@pytest.fixture(scope="session")
def real_gateway(tmp_path_factory) -> RealGateway:
    """`sluice serve` with the real engine and model, one per session, with one pro API key."""
    tmp = tmp_path_factory.mktemp("gateway")
    keys_file = tmp / "keys.json"
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "SLUICE_AUTH__KEYS_FILE": str(keys_file),
           "SLUICE_ENGINE__KV_CACHE_TOKENS": "16384",  # smaller pool: faster start, less memory
           # The serving default (the native CPU step) with its int16 matmuls for every step size: the
           # 32-concurrent test compares each answer with the same request run alone, and those give the
           # same tokens however requests are batched (tests/engine/test_invariance.py); the AMX tiles'
           # bf16 rounding depends on the step's size.
           "SLUICE_ENGINE__AMX_MIN_ROWS": "0",
           "SLUICE_ENGINE__MAX_MODEL_LEN": "2048",  # over-long prompts stay cheap to build and to cut
           "PYTHONPATH": str(ROOT)}
    env.pop("SLUICE_CONFIG", None)
    out = subprocess.run([sys.executable, "-m", "gateway.cli", "keys", "create", "--name", "tests",
                          "--tier", "pro"], env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    key = out.stdout.strip()
    port = free_port()
    log_path = tmp / "gateway.log"
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--port", str(port)],
                            env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    gw = RealGateway(f"http://127.0.0.1:{port}", key, keys_file, proc, log_path)
    deadline = time.time() + 300  # engine load is seconds, but the CI box is shared
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"gateway exited:\n{log_path.read_text()[-4000:]}")
        try:
            if gw.ready().get("status") == "ready":
                break
        except OSError:
            pass
        if time.time() > deadline:
            proc.kill()
            raise RuntimeError(f"gateway not ready in time:\n{log_path.read_text()[-4000:]}")
        time.sleep(0.2)
    yield gw
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


# ---------------------------------------------------------------- a real redis-server


class RedisServer:
    """A redis-server on a free port, data in its own folder (AOF on), restartable with its data."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "yes", "--appendfsync", "always", "--dir", str(self.workdir)],
            stdout=open(self.workdir / "redis.log", "a"), stderr=subprocess.STDOUT)
        deadline = time.time() + 10
        while time.time() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"redis-server did not start:\n{(self.workdir / 'redis.log').read_text()[-2000:]}")

    def stop(self, kill: bool = False) -> None:
        if self.proc is None:
            return
        if kill:
            self.proc.kill()
        else:
            self.proc.terminate()  # SIGTERM: redis-server flushes the AOF and exits
        self.proc.wait(timeout=10)
        self.proc = None

    def restart(self, down_s: float = 0.0) -> None:
        self.stop()
        time.sleep(down_s)
        self.start()


def _have_redis_server() -> bool:
    import shutil

    return shutil.which("redis-server") is not None


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    if not _have_redis_server():
        pytest.skip("redis-server is not installed (make test installs it: apt-get install redis-server)")
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()
