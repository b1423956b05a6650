"""A real `sluice serve` process on 0.0.0.0 with API keys, end to end: it fails closed on a broken keys file,
bounds its connections and guards /metrics."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from tests.fixtures.servers import ROOT, free_port


def _call(url: str, key: str | None = None, body: dict | None = None) -> tuple[int, dict | str]:
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            raw = r.read().decode()
            return r.status, json.loads(raw) if raw.startswith("{") else raw
    except urllib.error.HTTPError as e:
        raw = e.read().decode()
        return e.code, json.loads(raw) if raw.startswith("{") else raw


@pytest.mark.slow
def test_sluice_serve_fails_closed_bounds_connections_and_guards_metrics(tmp_path):
    keys_file = tmp_path / "keys.json"
    port = free_port()
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": str(ROOT),
           "SLUICE_AUTH__KEYS_FILE": str(keys_file), "SLUICE_ENGINE__KV_CACHE_TOKENS": "4096",
           "SLUICE_SERVER__HEADER_TIMEOUT_S": "1.0", "SLUICE_SERVER__SHUTDOWN_GRACE_S": "1"}
    env.pop("SLUICE_CONFIG", None)

    def cli(*args: str) -> str:
        return subprocess.run([sys.executable, "-m", "gateway.cli", *args], env=env, cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout.strip()

    key = cli("keys", "create", "--name", "team-a", "--tier", "pro")
    admin = cli("keys", "create", "--name", "ops", "--admin")
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--host", "0.0.0.0",
                                 "--port", str(port)], env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 300
        while True:
            assert proc.poll() is None, log_path.read_text()[-3000:]
            try:
                if _call(base + "/ready")[0] == 200:
                    break
            except OSError:
                pass
            assert time.time() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.2)
        models = _call(base + "/v1/models", key)[1]
        chat = {"model": models["data"][0]["id"], "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}

        # 8: /metrics needs an admin key and shows no key names.
        assert _call(base + "/metrics")[0] == 401
        assert _call(base + "/metrics", key)[0] == 403
        assert _call(base + "/v1/chat/completions", key, chat)[0] == 200
        st, text = _call(base + "/metrics", admin)
        assert st == 200 and "sluice_requests_total" in text and "team-a" not in text

        # 6: a half-open connection is closed within the header timeout.
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(b"POST /v1/chat/completions HTT")
            s.settimeout(1.0 + 1.5)
            t0 = time.monotonic()
            got = b""
            while chunk := s.recv(4096):
                got += chunk
            assert time.monotonic() - t0 < 2.5 and got.startswith(b"HTTP/1.1 408")

        # 5: the keys file disappears: never anonymous, 503 with a clear code, an error in the log.
        keys_file.unlink()
        for _ in range(10):
            st, body = _call(base + "/v1/chat/completions", None, chat)
            assert st == 503 and body["error"]["code"] == "keys_unavailable", (st, body)
        assert _call(base + "/v1/chat/completions", key, chat)[0] == 503
        assert _call(base + "/health")[0] == 200
        time.sleep(0.3)
        text = log_path.read_text()
        assert "ERROR" in text and "keys.json is missing" in text
        assert text.count("refusing API requests") <= 2  # rate-limited
        assert key not in text and admin not in text
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
