"""engine/memory.py: while a model loads, large temporaries go back to the OS when freed (glibc only).

Run in a fresh interpreter: a long-lived process's heap may hold a free chunk large enough for the
temporary, which glibc reuses whatever the threshold (the test would then measure the heap's history)."""

import subprocess
import sys
from pathlib import Path

import pytest

from engine import memory

pytestmark = pytest.mark.skipif(not memory.set_mmap_threshold(memory.SERVE_MMAP_THRESHOLD), reason="not glibc")

_SCRIPT = r'''
import torch
from engine import memory

MIB = 1 << 20


def rss_mib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))


def held_after_free(n_mib):
    """MiB still resident after a touched temporary of n_mib MiB is freed while one allocated after it
    lives (the heap's top is not free, so glibc cannot shrink it)."""
    before = rss_mib()
    first = torch.ones(n_mib * MIB, dtype=torch.uint8)
    second = torch.ones(n_mib * MIB, dtype=torch.uint8)
    del first
    held = rss_mib() - before - n_mib
    del second
    return held


memory.set_mmap_threshold(memory.SERVE_MMAP_THRESHOLD)  # a server's state after its first load
print("serving", held_after_free(24))
memory.release_freed_memory()
with memory.loading():
    print("loading", held_after_free(24))
    with memory.loading():  # a second engine loading beside the first
        pass
    print("still loading", held_after_free(24))
print("served", held_after_free(24))
'''


def test_a_load_hands_freed_temporaries_back() -> None:
    out = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=120, check=True,
                         cwd=Path(__file__).resolve().parents[2])
    held = {k: float(v) for k, _, v in (line.rpartition(" ") for line in out.stdout.splitlines())}
    assert held["serving"] > 20  # the case the module is for: from the heap, a freed block stays resident
    assert held["loading"] < 4  # while loading: mapped, unmapped when freed
    assert held["still loading"] < 4  # the outer load still holds the low threshold
    assert held["served"] > 20  # after the last load, the serving threshold again
