"""bench/gpu.sh --dry-run runs every step on the CPU (tiny shapes, interpreted Triton), so the GPU script cannot rot."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.triton
@pytest.mark.slow
def test_gpu_bench_dry_run():
    env = dict(os.environ, PYTHON=sys.executable, OMP_WAIT_POLICY="PASSIVE")
    env.pop("SLUICE_KERNELS", None)
    out = subprocess.run(["bash", str(ROOT / "bench" / "gpu.sh"), "--dry-run"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "all match their references" in out.stdout
    assert "kernels=triton (interpreted)" in out.stdout and "== done" in out.stdout
