"""Real processes for the admission tests: `sluice serve` (a remote-only model on the mock provider, so no
model loads and a start takes seconds), the mock provider, and plain HTTP calls with an API key."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from tests.gateway.conftest import ROOT, free_port
from tests.servers import wait_http_ok

PRICE_IN, PRICE_OUT = 1000.0, 2000.0  # per million tokens
CHAT = {"model": "remote-model", "messages": [{"role": "user", "content": "hello there"}]}


def env_for(config: Path) -> dict[str, str]:
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": str(ROOT), "SLUICE_CONFIG": str(config)}
    env.pop("SLUICE_REDIS_URL", None)
    return env


def start_mock(tmp_path: Path, *, tokens: int = 6, itl_ms: float = 0.0,
               ttft_ms: float = 0.0) -> tuple[subprocess.Popen, int]:
    """The mock provider (tests/remote/mock_provider.py) in its own process: `tokens` words per answer."""
    port = free_port()
    env = env_for(tmp_path / "none.toml")
    proc = subprocess.Popen([sys.executable, "-m", "tests.remote.mock_provider", "--port", str(port), "--tokens",
                             str(tokens), "--itl-ms", str(itl_ms), "--ttft-ms", str(ttft_ms)], cwd=ROOT, env=env,
                            stdout=open(tmp_path / f"mock-{port}.log", "w"), stderr=subprocess.STDOUT)
    _wait_port(port, proc)
    return proc, port


def _wait_port(port: int, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("the mock provider exited")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError("the mock provider did not start")


def write_config(path: Path, *, port: int, mock_port: int, tmp_path: Path, extra: str = "") -> Path:
    """A gateway serving `remote-model` on the mock provider only, keys in tmp_path; `extra`: more TOML."""
    path.write_text(f"""
[server]
port = {port}
shutdown_grace_s = 5
[model]
path = "{tmp_path / 'no-local-model'}"
[auth]
keys_file = "{tmp_path / 'keys.json'}"
[[providers]]
name = "mock"
base_url = "http://127.0.0.1:{mock_port}/v1"
models = {{ "remote-model" = "upstream-model" }}
input_price_per_m = {PRICE_IN}
output_price_per_m = {PRICE_OUT}
{extra}
""")
    return path


def create_key(config: Path, name: str, tier: str = "pro") -> str:
    return subprocess.run([sys.executable, "-m", "gateway.cli", "keys", "create", "--name", name, "--tier", tier],
                          cwd=ROOT, env=env_for(config), capture_output=True, text=True, check=True).stdout.strip()


class Gateway:
    """One `sluice serve` process; `stop()` sends SIGTERM (a graceful shutdown) and waits."""

    def __init__(self, config: Path, log: Path, port: int):
        self.config, self.log, self.port = config, log, port
        self.base = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve"], cwd=ROOT, env=env_for(config),
                                     stdout=open(log, "w"), stderr=subprocess.STDOUT)
        wait_http_ok(self.base + "/health", self.proc, log, timeout=180)

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode

    def text(self) -> str:
        return self.log.read_text()

    def call(self, path: str, key: str | None, body: dict[str, Any] | None = None) -> tuple[int, dict[str, Any]]:
        return call(self.base + path, key, body)


def call(url: str, key: str | None, body: dict[str, Any] | None = None,
         timeout: float = 30.0) -> tuple[int, dict[str, Any]]:
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=json.dumps(body).encode() if body is not None else None, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, json.loads(raw)
        except ValueError:
            return e.code, {"raw": raw.decode(errors="replace")}


def stop_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
