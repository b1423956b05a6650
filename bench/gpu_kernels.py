"""Each kernel against its torch reference: correctness on the device, then time and achieved bandwidth.

    python -m bench.gpu_kernels            # on a CUDA GPU (H200 peak 4.8 TB/s)
    python -m bench.gpu_kernels --dry-run  # CPU, tiny shapes, Triton under TRITON_INTERPRET=1

Bandwidth is bytes that must move (inputs read + outputs written, KV read once) over kernel time, as a
fraction of the H200's HBM peak; in dry-run mode the numbers only prove the script runs.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

HBM_BYTES_PER_S = 4.8e12


def timeit(fn, dev: str, iters: int) -> float:
    """Seconds per call (median of `iters` after warm-up)."""
    fn()
    if dev == "cuda":
        torch.cuda.synchronize()
        times = []
        for _ in range(iters):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
    else:
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def check(name, got, ref, dtype):
    tol = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}[dtype]
    err = (got.float() - ref.float()).abs().max().item()
    scale = max(1.0, ref.float().abs().max().item())
    ok = err <= tol * scale * 4
    print(f"  check {name:<38} max|err| {err:.2e} {'ok' if ok else 'FAIL'}")
    return ok


def report(name, t_tri, t_ref, nbytes):
    bw = nbytes / t_tri
    print(f"  {name:<44} triton {t_tri * 1e6:9.1f} us  torch {t_ref * 1e6:9.1f} us  x{t_ref / t_tri:5.2f}  "
          f"{bw / 1e9:8.1f} GB/s = {bw / HBM_BYTES_PER_S:6.1%} of 4.8 TB/s")


def paged_meta(lens_ctx, lens_new, bs, dev, seed=0):
    """Metadata for a step of sequences with `lens_ctx` cached tokens and `lens_new` new ones (decodes first)."""
    from kernels import AttentionMetadata

    g = torch.Generator().manual_seed(seed)
    lens = [c + n for c, n in zip(lens_ctx, lens_new)]
    need = [(n + bs - 1) // bs for n in lens]
    perm = torch.randperm(sum(need) + 1, generator=g)
    tables = torch.zeros(len(lens), max(need), dtype=torch.int32)
    slots, qsl, i = [], [0], 0
    for s, nb in enumerate(need):
        tables[s, :nb] = perm[i:i + nb].to(torch.int32)
        i += nb
        slots += [int(tables[s, p // bs]) * bs + p % bs for p in range(lens_ctx[s], lens[s])]
        qsl.append(qsl[-1] + lens_new[s])
    nd = sum(1 for n in lens_new if n == 1)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev), block_tables=tables.to(dev),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev), num_decodes=nd, block_size=bs,
        query_lens_host=list(lens_new), seq_lens_host=lens, max_decode_len=max(lens[:nd], default=0))
    return meta, (sum(need) + 1) * bs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true")
    a = ap.parse_args(argv)
    if a.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
    from kernels.reference.activation import silu_and_mul_ref
    from kernels.reference.kv_cache import write_kv_ref
    from kernels.reference.paged_attention import paged_attention_ref
    from kernels.reference.rms_norm import fused_add_rms_norm_ref
    from kernels.reference.rotary import rotary_inplace_ref
    from kernels.sampling import sample_tokens
    from kernels.triton.activation import silu_and_mul_triton
    from kernels.triton.kv_cache import write_kv_triton
    from kernels.triton.paged_attention import paged_attention_triton
    from kernels.triton.rms_norm import fused_add_rms_norm_triton
    from kernels.triton.rotary import rotary_inplace_triton

    dev = "cpu" if a.dry_run else "cuda"
    if dev == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run")
        return 2
    dt = torch.float32 if a.dry_run else torch.bfloat16
    iters = 2 if a.dry_run else 50
    el = dt.itemsize
    ok = True
    torch.manual_seed(0)
    print(f"kernels on {torch.cuda.get_device_name() if dev == 'cuda' else 'cpu (TRITON_INTERPRET=1)'}, {dt}")

    # -- paged attention: decode batches (Llama-1B and SmolLM2-135M head shapes) and a prefill/extend step
    if a.dry_run:
        att_cases = [("decode B2 ctx 20 H8/2 D64", 8, 2, 64, [19, 7], [1, 1]),
                     ("extend 1x(16 cached + 12 new)", 8, 2, 64, [16], [12])]
    else:
        att_cases = [("decode B1 ctx 4096 H32/8 D64 (1B)", 32, 8, 64, [4095], [1]),
                     ("decode B32 ctx 1024 H32/8 D64 (1B)", 32, 8, 64, [1023] * 32, [1] * 32),
                     ("decode B128 ctx 512 H9/3 D64 (135M)", 9, 3, 64, [511] * 128, [1] * 128),
                     ("decode B128 ctx 2048 H32/8 D128", 32, 8, 128, [2047] * 128, [1] * 128),
                     ("extend 4x(1024 cached + 512 new) H32/8 D64", 32, 8, 64, [1024] * 4, [512] * 4)]
    for name, h, hkv, d, ctx, new, in att_cases:
        meta, nslots = paged_meta(ctx, new, 16, dev)
        t = sum(new)
        q, k, v = (torch.randn(t, n, d, device=dev, dtype=dt) for n in (h, hkv, hkv))
        kc, vc = torch.randn(nslots, hkv, d, device=dev, dtype=dt), torch.randn(nslots, hkv, d, device=dev, dtype=dt)
        kc2, vc2 = kc.clone(), vc.clone()
        got = paged_attention_triton(q, k, v, kc, vc, meta)
        ok &= check(name, got, paged_attention_ref(q, k, v, kc2, vc2, meta), dt)
        kv_read = sum(c + n for c, n in zip(ctx, new)) * hkv * d * el * 2
        t_tri = timeit(lambda: paged_attention_triton(q, k, v, kc, vc, meta), dev, iters)
        t_ref = timeit(lambda: paged_attention_ref(q, k, v, kc2, vc2, meta), dev, iters)
        report(name, t_tri, t_ref, kv_read + 2 * q.numel() * el)

    # -- elementwise kernels
    tok, hid, inter, h, hkv, d = (6, 64, 96, 4, 2, 64) if a.dry_run else (8192, 2048, 8192, 32, 8, 64)
    x, r = torch.randn(tok, hid, device=dev, dtype=dt), torch.randn(tok, hid, device=dev, dtype=dt)
    w = torch.randn(hid, device=dev, dtype=dt)
    ok &= check("fused_add_rms_norm", fused_add_rms_norm_triton(x, r, w, 1e-5)[0],
                fused_add_rms_norm_ref(x, r, w, 1e-5)[0], dt)
    report(f"fused_add_rms_norm [{tok}, {hid}]", timeit(lambda: fused_add_rms_norm_triton(x, r, w, 1e-5), dev, iters),
           timeit(lambda: fused_add_rms_norm_ref(x, r, w, 1e-5), dev, iters), 4 * x.numel() * el)

    qkv = torch.randn(tok, (h + 2 * hkv) * d, device=dev, dtype=dt)
    qv, kv_ = qkv[:, :h * d].view(tok, h, d), qkv[:, h * d:(h + hkv) * d].view(tok, hkv, d)
    cos, sin = torch.randn(4096, d // 2, device=dev), torch.randn(4096, d // 2, device=dev)
    pos = torch.randint(0, 4096, (tok,), device=dev)
    q1, k1 = qv.clone(), kv_.clone()
    rotary_inplace_triton(q1, k1, cos, sin, pos)
    q2, k2 = qv.clone(), kv_.clone()
    rotary_inplace_ref(q2, k2, cos, sin, pos)
    ok &= check("rotary_inplace", torch.cat([q1.flatten(), k1.flatten()]), torch.cat([q2.flatten(), k2.flatten()]), dt)
    report(f"rotary_inplace [{tok}, {h}+{hkv}, {d}]", timeit(lambda: rotary_inplace_triton(qv, kv_, cos, sin, pos), dev, iters),
           timeit(lambda: rotary_inplace_ref(qv, kv_, cos, sin, pos), dev, iters), 2 * tok * (h + hkv) * d * el)

    gu = torch.randn(tok, 2 * inter, device=dev, dtype=dt)
    ok &= check("silu_and_mul", silu_and_mul_triton(gu), silu_and_mul_ref(gu), dt)
    report(f"silu_and_mul [{tok}, 2x{inter}]", timeit(lambda: silu_and_mul_triton(gu), dev, iters),
           timeit(lambda: silu_and_mul_ref(gu), dev, iters), 3 * tok * inter * el)

    kk, vv = torch.randn(tok, hkv, d, device=dev, dtype=dt), torch.randn(tok, hkv, d, device=dev, dtype=dt)
    slots = torch.randperm(2 * tok, device=dev)[:tok]
    kc, vc = torch.zeros(2 * tok, hkv, d, device=dev, dtype=dt), torch.zeros(2 * tok, hkv, d, device=dev, dtype=dt)
    kc2, vc2 = kc.clone(), vc.clone()
    write_kv_triton(kk, vv, kc, vc, slots)
    write_kv_ref(kk, vv, kc2, vc2, slots)
    ok &= check("write_kv", torch.cat([kc, vc]), torch.cat([kc2, vc2]), dt)
    report(f"write_kv [{tok}, {hkv}, {d}]", timeit(lambda: write_kv_triton(kk, vv, kc, vc, slots), dev, iters),
           timeit(lambda: write_kv_ref(kk, vv, kc2, vc2, slots), dev, iters), 4 * kk.numel() * el)

    # -- sampler (torch device ops; no triton). On CUDA, any host synchronisation is an error.
    b, vocab = (4, 50) if a.dry_run else (128, 128256)
    logits = torch.randn(b, vocab, device=dev)
    args = (torch.rand(b, device=dev), torch.randint(0, 50, (b,), device=dev), torch.rand(b, device=dev),
            torch.randint(0, 2**62, (b,), device=dev), torch.arange(b, device=dev))
    if dev == "cuda":
        torch.cuda.set_sync_debug_mode("error")
    sample_tokens(logits, *args)
    if dev == "cuda":
        torch.cuda.set_sync_debug_mode("default")
    ts = timeit(lambda: sample_tokens(logits, *args), dev, iters)
    tg = timeit(lambda: sample_tokens(logits, *args, filter_top=False), dev, iters)
    print(f"  sample_tokens [{b}, {vocab}] (no host sync)     with top-k/p {ts * 1e6:9.1f} us  "
          f"temperature only {tg * 1e6:9.1f} us")
    print("kernels:", "all match their references" if ok else "SOME KERNELS DISAGREE WITH THEIR REFERENCES")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
