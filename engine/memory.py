"""The process's heap while a model loads: what the loader frees goes back to the OS.

Repacking a model's weights allocates and frees hundreds of temporaries of up to tens of MiB (a tensor's
codes, scales, the output layer's slices). glibc serves an allocation from its heap below its mmap
threshold, and raises that threshold to the size of each mmapped block freed (up to 32 MiB), so after the
first few tensors every temporary comes from the heap, whose freed pages stay resident until the top of the
heap is free. Loading a Llama-3.2-1B-shaped Q4_K_M file peaked at 1,680-1,700 MiB that way, to settle at
1,260. With the threshold held at 16 MiB while a model loads, the largest temporaries are their own
mappings, unmapped when freed: the peak is 1,430-1,460 MiB, for 0.6 s more of a 9 s start (fresh pages are
faulted in; at 1 MiB the peak was 1,330 MiB, but the start took 2.3 s longer).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import threading
from collections.abc import Iterator

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
LOAD_MMAP_THRESHOLD = 16 << 20  # while loading: every temporary of 16 MiB or more is its own mapping
SERVE_MMAP_THRESHOLD = 32 << 20  # after: where glibc's own threshold settles (its maximum on 64-bit)

_lock = threading.Lock()
_loading = 0  # loads in progress (engines may load side by side, one per model)


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt  # noqa: B018 (glibc only)
        return libc
    except (OSError, AttributeError):
        return None


def set_mmap_threshold(nbytes: int) -> bool:
    """glibc's mmap threshold, fixed (no longer raised as blocks are freed); False where there is no glibc."""
    libc = _libc()
    return libc is not None and libc.mallopt(M_MMAP_THRESHOLD, nbytes) == 1


@contextlib.contextmanager
def loading() -> Iterator[None]:
    """Inside, allocations of 16 MiB or more are mapped (and unmapped when freed); when the last load ends,
    the threshold goes to 32 MiB (a step's buffers come from the heap and are reused) and what was freed is
    handed back (`release_freed_memory`)."""
    global _loading
    with _lock:
        _loading += 1
        set_mmap_threshold(LOAD_MMAP_THRESHOLD)
    try:
        yield
    finally:
        with _lock:
            _loading -= 1
            if _loading == 0:
                set_mmap_threshold(SERVE_MMAP_THRESHOLD)
        release_freed_memory()


def release_freed_memory() -> None:
    """Hands memory Python and torch have freed back to the OS (glibc keeps freed heap pages otherwise,
    so the process would go on holding the loader's temporary copies)."""
    gc.collect()
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
