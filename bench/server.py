"""Starts `sluice serve` (or another OpenAI-compatible server) on a free port for a benchmark, and stops it."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, timeout: float = 300.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except Exception:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{url} not ready after {timeout}s")


def wait_listening(port: int, proc: subprocess.Popen, log_name: str, timeout: float = 30.0) -> None:
    deadline = time.time() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} (log {log_name})")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            return
        if time.time() > deadline:
            raise TimeoutError(f"port {port} not listening after {timeout:.0f} s")
        time.sleep(0.2)


@contextlib.contextmanager
def managed_server(cmd: list[str], ready: str | int, env: dict[str, str], cwd: str | Path | None = None):
    """Runs `cmd` until the block ends (terminate, then kill), once it is ready: `ready` is a URL that must
    answer 200, or a port that must accept connections (a server with no GET route); logs to a temp file."""
    log = open(tempfile.mktemp(prefix="sluice-bench-", suffix=".log"), "w")
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        if isinstance(ready, int):
            wait_listening(ready, proc, log.name)
        else:
            wait_ready(ready, proc=proc)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@contextlib.contextmanager
def sluice_server(env_overrides: dict[str, str] | None = None, args: list[str] | None = None):
    """Yields the base URL (http://127.0.0.1:PORT/v1) of a fresh `sluice serve` with no API keys."""
    with sluice_server_process(env_overrides, args) as (url, _):
        yield url


@contextlib.contextmanager
def sluice_server_process(env_overrides: dict[str, str] | None = None, args: list[str] | None = None):
    """Yields (base URL, the server's Popen) of a fresh `sluice serve` with no API keys."""
    port = free_port()
    tmp = tempfile.mkdtemp(prefix="sluice-bench-")
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "SLUICE_AUTH__KEYS_FILE": f"{tmp}/keys.json",
           "PYTHONPATH": str(ROOT), **(env_overrides or {})}
    env.pop("SLUICE_CONFIG", None)
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--port", str(port), *(args or [])]
    with managed_server(cmd, f"http://127.0.0.1:{port}/ready", env, cwd=ROOT) as proc:
        yield f"http://127.0.0.1:{port}/v1", proc
