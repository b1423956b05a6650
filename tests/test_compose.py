"""docker-compose.yml is valid (no Docker engine needed: `docker compose config` only parses it)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.fixtures.servers import ROOT


def _compose() -> list[str] | None:
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


def test_compose_file_is_valid():
    compose = _compose()
    if compose is None:
        pytest.skip("neither `docker compose` nor docker-compose is installed")
    base = [*compose, "-f", str(ROOT / "docker-compose.yml")]
    out = subprocess.run([*base, "config", "--services"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert {"redis", "gateway", "worker", "embedding-worker"} <= set(out.stdout.split())
    out = subprocess.run([*base, "--profile", "gpu", "config"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "worker-gpu" in out.stdout and "appendonly" in out.stdout and "nvidia" in out.stdout
