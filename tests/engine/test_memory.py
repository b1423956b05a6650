"""engine/memory.py: while a model loads, large temporaries go back to the OS when freed (glibc only)."""

import pytest
import torch

from engine import memory

MIB = 1 << 20


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _held_after_free(n_mib: int) -> float:
    """MiB still resident after a touched temporary of n_mib MiB is freed while one allocated after it lives
    (the heap's top is not free, so glibc cannot shrink it)."""
    before = _rss_mib()
    first = torch.ones(n_mib * MIB, dtype=torch.uint8)
    second = torch.ones(n_mib * MIB, dtype=torch.uint8)
    del first
    held = _rss_mib() - before - n_mib
    del second
    return held


pytestmark = pytest.mark.skipif(not memory.set_mmap_threshold(memory.SERVE_MMAP_THRESHOLD), reason="not glibc")


def test_heap_keeps_a_freed_temporary_outside_a_load() -> None:
    # The case the module is for: below the serving threshold, a freed block stays resident.
    memory.set_mmap_threshold(memory.SERVE_MMAP_THRESHOLD)
    assert _held_after_free(24) > 20
    memory.release_freed_memory()


def test_a_load_hands_freed_temporaries_back() -> None:
    with memory.loading():
        assert _held_after_free(24) < 4
        with memory.loading():  # a second engine loading beside the first
            pass
        assert _held_after_free(24) < 4  # the outer load still holds the low threshold
    assert _held_after_free(24) > 20  # and after the last, the serving one
    memory.release_freed_memory()
