"""The native decode attention alone: its read rate from a paged KV pool, against the same arithmetic on
keys already in L1 and against a plain read of the same bytes.

`decode_roofline --context N` shows attention taking most of a long-context step (SmolLM2, 16 rows, 1,024
positions: ~40 of ~74 ms on the AVX2 build). This asks why, with three timings of one layer stack's
`sluice_decode_attention` (30 layers, each sequence's blocks anywhere in the pool, as a long-running
server's are):

- pool: the real case (blocks shuffled over the pool; far beyond the caches).
- resident: the same calls with every block table pointing at one block (the keys and values stay in
  L1): the kernel's arithmetic alone.
- read: a plain streaming read of as many bytes (`decode_roofline`'s read bandwidth).

If pool ~ resident + read, the kernel's memory reads and its arithmetic do not overlap; if pool ~ the
larger of the two, they do. Printed with the machine's CPU flags; compare ratios from one run only.

    python -m bench.attention_rate [--context 1024] [--batch 16] [--threads 2]
    SLUICE_NATIVE_MARCH=x86-64-v3 python -m bench.attention_rate   # the AVX2 build on an AVX-512 CPU
"""

from __future__ import annotations

import argparse
import time

import torch

import kernels.cpu as cpu_kernels
from bench.common import machine
from bench.decode_roofline import read_bandwidth
from kernels.cpu import build


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=1024, help="positions per sequence")
    ap.add_argument("--batch", type=int, default=16, help="sequences (one decode row each)")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--heads", type=int, default=9, help="query heads (SmolLM2's 9)")
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds of the three timings")
    a = ap.parse_args(argv)
    if a.context % a.block_size:
        raise SystemExit("--context must be a multiple of --block-size")
    lib = build.load()
    if lib is None:
        raise SystemExit("no native CPU step on this machine (no C compiler)")
    torch.manual_seed(0)
    blocks = a.batch * a.context // a.block_size
    slots = blocks * a.block_size
    k = [torch.randn(slots, a.kv_heads, a.head_dim).to(torch.bfloat16) for _ in range(a.layers)]
    v = [torch.randn(slots, a.kv_heads, a.head_dim).to(torch.bfloat16) for _ in range(a.layers)]
    tables = {"pool": torch.randperm(blocks).view(a.batch, -1).to(torch.int32),
              "resident": torch.zeros(a.batch, blocks // a.batch, dtype=torch.int32)}
    lens = torch.full((a.batch,), a.context, dtype=torch.int32)
    q = torch.randn(a.batch, a.heads, a.head_dim)
    nbytes = 2 * a.layers * a.batch * a.context * a.kv_heads * a.head_dim * 2  # K and V, bf16

    def attend(table: torch.Tensor) -> float:
        t = time.perf_counter()
        for layer in range(a.layers):
            cpu_kernels.decode_attention(q, k[layer], v[layer], table, lens, a.block_size, a.threads, lib)
        return time.perf_counter() - t

    best = {"pool": float("inf"), "resident": float("inf"), "read": float("inf")}
    for table in tables.values():
        attend(table)  # (first touch, the library's load)
    for _ in range(a.rounds):
        for name, table in tables.items():
            best[name] = min(best[name], *(attend(table) for _ in range(3)))
        best["read"] = min(best["read"], nbytes / read_bandwidth(max(nbytes, 256 * 2**20)))

    print(f"machine: {machine()}; torch threads {torch.get_num_threads()}, kernel threads {a.threads}")
    print(f"native decode attention, build {lib.sluice_forward_isa().decode()}: {a.batch} sequences x {a.context} positions, "
          f"{a.layers} layers, {a.heads} / {a.kv_heads} heads of {a.head_dim}: {nbytes / 2**20:.0f} MiB of K and V")
    for name, what in (("pool", "blocks anywhere in the pool"), ("resident", "keys in L1: arithmetic alone"),
                       ("read", "a plain read of the same bytes")):
        print(f"  {name:9s} {best[name] * 1e3:7.1f} ms  {nbytes / best[name] / 1e9:5.1f} GB/s  ({what})")
    both, longer = best["resident"] + best["read"], max(best["resident"], best["read"])
    print(f"pool / (resident + read) {best['pool'] / both:.2f}; pool / max(resident, read) {best['pool'] / longer:.2f} "
          "(1.0 on the first: reads and arithmetic in turn, none overlapped)")


if __name__ == "__main__":
    main()
