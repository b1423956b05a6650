"""Weights on 2 MiB pages: the buffers the native step streams every decode step.

A decode step reads every weight once, and on 4 KiB pages that is a new page, so a TLB miss and a page
walk, every 4 KiB: 188 thousand of them for the Llama-3.2-1B shape's 733 MiB a token. Linux backs
anonymous memory with 2 MiB pages (transparent huge pages) where asked (`madvise(MADV_HUGEPAGE)`; the
default "madvise" mode gives them to no one else), so the weights' buffers are mapped here, aligned to
2 MiB, and asked for them before they are first written. The 1B shape's AVX2 batch-1 decode step on a
Xeon (`bench.decode_roofline --batches 1 --steps 60`, three alternating runs): 42.6 / 40.5 / 39.7 ms on
torch's own allocations, 37.5 / 37.9 / 35.8 ms on these (its linear layers 29.2 -> 25.8 ms).
"""

from __future__ import annotations

import mmap

import torch

HUGE_PAGE = 2 << 20


def empty_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous tensor in memory asked to be backed by 2 MiB pages (its first whole
    2 MiB of address on, aligned), or torch.empty where that cannot be asked (a kernel without
    transparent huge pages, a platform without `madvise`) or is not worth it (under 2 MiB)."""
    n = dtype.itemsize
    for s in shape:
        n *= s
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or n < HUGE_PAGE:
        return torch.empty(shape, dtype=dtype)
    m = mmap.mmap(-1, n + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(m, dtype=torch.uint8)  # (holds `m`: unmapped when the last view goes)
    start = -raw.data_ptr() % HUGE_PAGE
    try:  # only the whole 2 MiB pages of the tensor: a huge page across its end would be partly unused
        m.madvise(advice, start, n - n % HUGE_PAGE)
    except OSError:  # (EINVAL: transparent huge pages are not built into this kernel)
        return torch.empty(shape, dtype=dtype)
    return raw[start:start + n].view(dtype).view(shape)


def on_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """`t`'s values in a tensor of `empty_on_huge_pages`; t itself where that would give plain memory, or
    where t starts on a 2 MiB boundary (taken as placed already: torch's own allocations do not)."""
    if t.device.type != "cpu" or t.numel() * t.element_size() < HUGE_PAGE or t.data_ptr() % HUGE_PAGE == 0:
        return t
    return empty_on_huge_pages(tuple(t.shape), t.dtype).copy_(t)
